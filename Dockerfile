# The pjrt-rendezvous coordinator image: the package and its gRPC dependencies, no torch.
#
#   docker build -t pjrt-rendezvous .
#   docker run -d --name coordinator --restart unless-stopped --stop-timeout 30 -p 7481:7481 -p 7482:7482 \
#     -v pjrt-state:/var/lib/pjrt-rendezvous pjrt-rendezvous
#   docker exec coordinator pjrt-rendezvous status
#
# Configuration: PJRT_RENDEZVOUS_* variables (docker run -e ...) or flags after the image
# name, which replace CMD: `docker run ... pjrt-rendezvous serve --world-size 32`. Set the
# host and ports with the variables (-e PJRT_RENDEZVOUS_PORT=...), not flags: the health
# check and `status` read them to find the server. Every serve flag and its variable:
# `docker run --rm pjrt-rendezvous serve --help`; the list is in deploy/README.md. The state file lives on the volume, so a restarted container resumes
# the job with the same ordinals.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# A C compiler for the package's native path (client/_native.c; only this stage has it).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# A virtual environment at the same path as in the final stage: copied as a whole.
RUN python -m venv /opt/pjrt-rendezvous
WORKDIR /src
COPY pyproject.toml README.md ./
COPY coordinator coordinator
COPY client client
COPY protos protos
RUN /opt/pjrt-rendezvous/bin/pip install --no-cache-dir --disable-pip-version-check . \
 && /opt/pjrt-rendezvous/bin/python -c "import pjrt_rendezvous.client._native" \
 && /opt/pjrt-rendezvous/bin/pjrt-rendezvous --version

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 pjrt \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/pjrt-rendezvous --no-create-home \
      --shell /usr/sbin/nologin pjrt \
 && mkdir -p /var/lib/pjrt-rendezvous \
 && chown 10001:10001 /var/lib/pjrt-rendezvous
COPY --from=build /opt/pjrt-rendezvous /opt/pjrt-rendezvous
ENV PATH=/opt/pjrt-rendezvous/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    GRPC_VERBOSITY=ERROR \
    PJRT_RENDEZVOUS_HOST=0.0.0.0 \
    PJRT_RENDEZVOUS_PORT=7481 \
    PJRT_RENDEZVOUS_STATE_FILE=/var/lib/pjrt-rendezvous/coordinator.state
VOLUME ["/var/lib/pjrt-rendezvous"]
WORKDIR /var/lib/pjrt-rendezvous
USER 10001:10001
EXPOSE 7481 7482
# The gRPC health service through the project's own CLI: exit code 0 when SERVING (1 when
# not; 2, a bad setting, which Docker reserves, it counts as unhealthy as well). It
# checks this container (127.0.0.1 at PJRT_RENDEZVOUS_PORT) and needs no token; with TLS,
# set PJRT_RENDEZVOUS_TLS_CA (and PJRT_RENDEZVOUS_TLS_SERVER_NAME if the certificate does
# not name 127.0.0.1), and with mutual TLS (--tls-ca) also PJRT_RENDEZVOUS_TLS_CERT and
# _TLS_KEY: a client certificate that CA signed.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10s --retries=3 \
  CMD ["pjrt-rendezvous", "health", "--timeout", "3"]
# SIGTERM (docker stop) drains in-flight calls for PJRT_RENDEZVOUS_GRACE seconds (default 5).
STOPSIGNAL SIGTERM
ENTRYPOINT ["pjrt-rendezvous"]
CMD ["serve"]
