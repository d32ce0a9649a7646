/* The AVX-512F build of kvcopy.c (setup.py compiles this file with -mavx512f; a separate file keeps its object apart). */
#include "kvcopy.c"
