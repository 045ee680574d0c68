# prefixq on a GPU host: the vLLM release image (vLLM 0.26, CUDA) plus this package.
# Build: docker build -t prefixq:gpu .
FROM vllm/vllm-openai:v0.26.0
WORKDIR /app
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir ".[gpu,serve]"
ENTRYPOINT ["prefixq"]
