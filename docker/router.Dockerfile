# vllm-router (the vLLM project's Rust router, from PyPI) in a small image of its own, for the
# compose file's `scale` profile. Pinned: a new router release can change the request fields it
# forwards (see README, "Several GPUs").
FROM python:3.12.12-slim
RUN pip install --no-cache-dir vllm-router==0.1.17
# nobody: the router needs no privilege
USER 65534:65534
EXPOSE 8080 29000
ENTRYPOINT ["vllm-router"]
