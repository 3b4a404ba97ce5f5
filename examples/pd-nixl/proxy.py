"""The proxy in front of the P/D example: every request goes to a prefill node first, then to a
decode node with the ``kv_transfer_params`` the prefill returned.

    python examples/pd-nixl/proxy.py --prefill http://PREFILL:8100 --decode http://DECODE:8200

It serves ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not) on ``--port``
(default 8000). The prefill copy of a request asks for one token, without streaming, and with
``kv_transfer_params = {"do_remote_decode": true, ...}``: the prefill node (stock vLLM +
NixlConnector, ``kv_role`` ``kv_producer``) then keeps the request's KV blocks and answers with
the ``kv_transfer_params`` that say where they are. The decode node (this package's connector,
``kv_role`` ``kv_consumer``) gets the original request plus those parameters and reads the KV
over NIXL. Several ``--prefill`` / ``--decode`` URLs are used in turn. Needs only what vLLM
installs (fastapi, uvicorn, httpx).
"""

# No ``from __future__ import annotations``: FastAPI reads the handlers' annotations.
import argparse
import itertools
from typing import Any

#: What a prefill request asks of the prefill node's NixlConnector: keep the blocks for a
#: remote decode; nothing to read from elsewhere.
PREFILL_KV_TRANSFER_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False,
                              "remote_engine_id": None, "remote_block_ids": None,
                              "remote_host": None, "remote_port": None}


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill node's copy of a client request: one token, no streaming."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out.update(max_tokens=1, stream=False, kv_transfer_params=dict(PREFILL_KV_TRANSFER_PARAMS))
    if "max_completion_tokens" in body:  # chat completions accept both names
        out["max_completion_tokens"] = 1
    return out


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode node's copy: the client's request plus the prefill's ``kv_transfer_params``."""
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise ValueError("the prefill node returned no kv_transfer_params: is it running vLLM "
                         'with --kv-transfer-config \'{"kv_connector": "NixlConnector", '
                         '"kv_role": "kv_producer"}\'?')
    return {**body, "kv_transfer_params": params}


def make_app(prefill_urls: list[str], decode_urls: list[str], client: Any = None):
    """The FastAPI app; ``client`` is an ``httpx.AsyncClient`` (tests pass a mock transport)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    client = client or httpx.AsyncClient(timeout=None)
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    app = FastAPI()

    async def forward(request: Request, path: str):
        body = await request.json()
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization",
                                                                            "x-request-id")}
        prefill = await client.post(next(prefills) + path, json=prefill_request(body),
                                    headers=headers)
        if prefill.status_code != 200:
            return JSONResponse(prefill.json(), status_code=prefill.status_code)
        try:
            decode_body = decode_request(body, prefill.json())
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=502)
        decode_url = next(decodes) + path
        if not body.get("stream"):
            decoded = await client.post(decode_url, json=decode_body, headers=headers)
            return JSONResponse(decoded.json(), status_code=decoded.status_code)

        async def chunks():
            async with client.stream("POST", decode_url, json=decode_body,
                                     headers=headers) as streamed:
                async for chunk in streamed.aiter_bytes():
                    yield chunk

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        return JSONResponse((await client.get(decode_urls[0] + "/v1/models")).json())

    @app.get("/health")
    async def health():
        return JSONResponse({"prefill": prefill_urls, "decode": decode_urls})

    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="prefill node(s), e.g. http://10.0.0.1:8100")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="decode node(s), e.g. http://10.0.0.2:8200")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    import uvicorn

    strip = [url.rstrip("/") for url in args.prefill], [url.rstrip("/") for url in args.decode]
    uvicorn.run(make_app(*strip), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
