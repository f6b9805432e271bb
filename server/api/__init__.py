"""The HTTP front end: FastAPI apps, schemas, guards, metrics, the server's life."""
