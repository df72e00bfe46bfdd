# GPU image for ga-train. Build:  docker build -t gacli .
# Run:    docker run --gpus all -v "$PWD/runs:/runs" gacli config=unet.yaml accum_steps=8
# The base is the official TensorFlow GPU image (CUDA and cuDNN included); pick another tag with
# --build-arg TF_IMAGE=tensorflow/tensorflow:2.21.0-gpu-jupyter, for instance.
ARG TF_IMAGE=tensorflow/tensorflow:2.21.0-gpu
FROM ${TF_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/gacli
COPY pyproject.toml README.md ./
COPY gacli ./gacli
COPY configs ./configs
COPY recipes ./recipes
# The base image's TensorFlow satisfies the tensorflow requirement, so only gacli's other
# dependencies are downloaded.
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 1000 --user-group gacli \
    && mkdir -p /runs \
    && chown 1000:1000 /runs

USER 1000:1000
# Runs write outputs/ and multirun/ under the working directory: mount a volume here.
WORKDIR /runs
VOLUME ["/runs"]
ENTRYPOINT ["ga-train"]
