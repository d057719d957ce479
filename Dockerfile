# The ETT image: the service, the agent, the trainer and the ett library (one image, the command picks the role).
FROM python:3.11.10-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned, the CPU build from PyTorch's index: PyPI's default wheel pulls GBs of CUDA.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /src
COPY pyproject.toml README.md ./
COPY ett ett
COPY ett_cli ett_cli
COPY service service
COPY agent agent
COPY trainer trainer
COPY migrations migrations
RUN pip install '.[postgres]' && rm -rf /src

# An unprivileged user; /run/ett is created here so a named volume mounted there is its to write.
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/ett ett \
    && mkdir -p /run/ett /var/lib/ett/checkpoints /var/lib/ett/agent \
    && chown -R ett /run/ett /var/lib/ett
USER ett
WORKDIR /var/lib/ett
EXPOSE 8000
ENTRYPOINT ["ett"]
CMD ["service", "run", "--host", "0.0.0.0"]
