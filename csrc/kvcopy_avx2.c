/* The AVX2 build of kvcopy.c (setup.py compiles this file with -mavx2; a separate file keeps its object apart). */
#include "kvcopy.c"
