"""The bridge between the HTTP front end and the engine: the engine's process (or thread), the pipe
between them, typed messages, and the asyncio side that streams each request's outputs."""
