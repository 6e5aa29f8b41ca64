# The draft service: request-local suffix matches and shared contexts in Redis, for speculative rounds.
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY services ./services
COPY operator ./operator
COPY protos ./protos
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --find-links /wheels "cascadia[draft]==0.1.0" && rm -rf /wheels
RUN groupadd --system --gid 10001 cascadia \
    && useradd --system --uid 10001 --gid cascadia --no-create-home cascadia
USER 10001:10001
EXPOSE 7100
ENTRYPOINT ["cascadia"]
CMD ["draft", "--help"]
