"""The OpenAI `/v1/audio/speech` API in front of the Triton sequence model: `app` (FastAPI routes), `bridge`
(one gRPC sequence per request, through q3tts_client), `audio` (response formats), `server` (uvicorn in a
thread) and `cli` (`q3tts openai`; `q3tts serve --openai-port` starts it beside Triton)."""
