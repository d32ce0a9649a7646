"""AWS Signature Version 4 for plain ``urllib`` / ``http.client`` requests to the test S3 server.

It creates buckets (no S3 client here creates one) and is the raw GET/PUT baseline of ``benchmarks/obj_clients.py``:
path-style URLs, ``UNSIGNED-PAYLOAD``, region ``us-east-1``.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import urllib.parse
import urllib.request

__all__ = ["sign_headers", "signed_request"]


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def sign_headers(
    method: str, url: str, access_key: str, secret_key: str, *, region: str = "us-east-1"
) -> dict[str, str]:
    """The headers that sign ``method url`` (the body is not signed: ``UNSIGNED-PAYLOAD``)."""
    parts = urllib.parse.urlsplit(url)
    now = datetime.datetime.now(datetime.UTC)
    stamp, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
    headers = {"host": parts.netloc, "x-amz-content-sha256": "UNSIGNED-PAYLOAD", "x-amz-date": stamp}
    names = sorted(headers)
    query = "&".join(sorted(q for q in parts.query.split("&") if q))
    canonical = "\n".join(
        [
            method,
            urllib.parse.quote(parts.path or "/"),
            query,
            "".join(f"{k}:{headers[k]}\n" for k in names),
            ";".join(names),
            "UNSIGNED-PAYLOAD",
        ]
    )
    scope = f"{day}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = _hmac(_hmac(_hmac(_hmac(f"AWS4{secret_key}".encode(), day), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (
        f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={';'.join(names)}, Signature={signature}"
    )
    return headers


def signed_request(
    method: str, url: str, access_key: str, secret_key: str, data: bytes | None = None
) -> urllib.request.Request:
    """A ``urllib`` request for ``method url`` signed with the key pair."""
    return urllib.request.Request(
        url, data=data, method=method, headers=sign_headers(method, url, access_key, secret_key)
    )
