# The coordinator image: the package and its gRPC dependencies only (no torch).
#   docker build -t pjrt-rendezvous .
#   docker run -p 7481:7481 pjrt-rendezvous            # serve on 0.0.0.0:7481
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY coordinator coordinator
COPY client client
COPY protos protos
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --create-home --home-dir /var/lib/pjrt-rendezvous pjrt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
USER pjrt
WORKDIR /var/lib/pjrt-rendezvous
EXPOSE 7481
ENTRYPOINT ["pjrt-rendezvous", "serve", "--host", "0.0.0.0", "--port", "7481"]
