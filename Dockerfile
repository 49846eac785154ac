# symgate: debuginfod caching proxy and symbol cache server.
#   docker build -t symgate .
#   docker run -p 8002:8002 -v symgate-data:/data symgate
# Configuration: mount a TOML file and set SYMGATE_CONFIG, or pass DEBUGINFOD_URLS.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
COPY symbolize ./symbolize
COPY migrations ./migrations
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# libdw1: elfutils' DWARF reader, for function names, start lines and the lines symbolic's
# SymCache lacks (symbolize/dwarf.py; without it those fall back to the symbol table), and for
# the debug files that dwz gave a supplementary file (symbolize/supplementary.py).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libdw1 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --home-dir /data --shell /usr/sbin/nologin symgate \
    && mkdir -p /data \
    && chown symgate /data
COPY --from=build /wheels /wheels
# hadolint ignore=DL3013
RUN pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels
COPY docker/entrypoint.sh /usr/local/bin/symgate-entrypoint
USER 10001
ENV SYMGATE_LISTEN=0.0.0.0:8002 \
    SYMGATE_DATA_DIR=/data \
    PYTHONUNBUFFERED=1
VOLUME ["/data"]
EXPOSE 8002
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["symgate-entrypoint", "healthcheck"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["symgate-entrypoint"]
CMD ["serve"]
