"""flashmask's tests: cpu/ runs anywhere (CI), gpu/ needs one CUDA GPU and the built kernels,
multigpu/ two or more GPUs with NCCL, tools/ the development tools. Shared helpers live here."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
