# A shard: one layer range on the Intel iGPU through OpenVINO's GPU plugin.
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY services ./services
COPY operator ./operator
COPY protos ./protos
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.11-slim-bookworm
# The Intel GPU compute runtime (OpenCL and Level Zero) that OpenVINO's GPU plugin drives.
RUN apt-get update \
    && apt-get install -y --no-install-recommends intel-opencl-icd=22.43.24595.41-1 ocl-icd-libopencl1=2.3.1-1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --find-links /wheels "cascadia[shard]==0.1.0" && rm -rf /wheels
# /dev/dri/renderD* belongs to the render group; the pod adds the node's render gid as a supplemental group.
RUN groupadd --system --gid 10001 cascadia \
    && useradd --system --uid 10001 --gid cascadia --no-create-home cascadia \
    && groupadd --system --gid 110 render \
    && usermod --append --groups render,video cascadia
USER 10001:10001
EXPOSE 7000
ENTRYPOINT ["cascadia"]
CMD ["shard", "--help"]
