"""The HTTP front end of qeff-kv serve: OpenAI's routes (app.py) and response shapes (responses.py,
openai_responses.py; the request vocabulary is :mod:`qeff_kv.serve.wire`), request bodies, errors, metrics,
discovery, images, the chat page (static/) and the HTTP section of the serve options (http_config.py)."""
