"""The HTTP front end of qeff-kv serve: OpenAI's routes (app.py) and shapes (openai_io.py, responses.py,
openai_responses.py), request bodies, errors, metrics, discovery, images and the chat page (static/)."""
