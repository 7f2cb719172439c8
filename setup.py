from setuptools import find_packages, setup

setup(
    name="fuser",
    version="0.1.0",
    description="A JIT fusion compiler for PyTorch's pointwise ops (TorchScript graph fuser rebuilt in Python)",
    packages=find_packages(include=["fuser", "fuser.*"]),
    package_data={"fuser.native": ["hotpath.cpp"]},  # compiled on first use (fuser/native/build.py)
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.11",
        "cuda-python>=12.6",  # cuda.bindings: NVRTC and the driver API
        "nvidia-cuda-nvrtc",  # the NVRTC library itself, so kernels compile even on machines without a GPU
    ],
    # torch.compile(model, backend="fuser") with no import: Dynamo looks its backends up in this group
    entry_points={"torch_dynamo_backends": ["fuser = fuser.dynamo:backend"]},
    extras_require={"test": ["pytest>=7", "pytest-xdist", "numpy", "transformers"], "bench": ["matplotlib"]},
)
