"""POST /v1/responses, OpenAI's Responses API, stateless: protocol.py (the request and how its input
items become a chat conversation), output.py (the reply as output items and stream events),
serving.py (the route, over the chat route's machinery)."""
