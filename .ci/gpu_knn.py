"""k-NN retrieval at Stanford Online Products' scale (60,000 x 128, 11,316 classes of about 5):
the test metrics through faiss on the CPU against the torch search on the GPU (`TorchFlatL2`),
same values (ties aside), and each one's time. Part of `bash .ci/gpu`."""

import json
import os
import time

import numpy as np
import torch

from pml_rank.harness.evaluation import METRICS, accuracy

rng = np.random.default_rng(0)
labels = np.repeat(np.arange(12000), 5)[:60000]
embeddings = (rng.standard_normal((12000, 128))[labels] * 0.5 + rng.standard_normal((60000, 128))).astype(np.float32)
embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
result = {"queries": len(embeddings), "dim": 128, "cpu_threads": os.cpu_count()}
for device, backend in (("cuda", "torch on the GPU"), ("cpu", "faiss-cpu")):
    accuracy(embeddings[:2000], labels[:2000], device=device)  # first-call costs
    torch.cuda.synchronize()
    started = time.perf_counter()
    values = accuracy(embeddings, labels, device=device)
    result[backend] = {"seconds": round(time.perf_counter() - started, 3), "metrics": values}
result["largest difference"] = max(
    abs(result["faiss-cpu"]["metrics"][m] - result["torch on the GPU"]["metrics"][m]) for m in METRICS
)
print(json.dumps(result, indent=2))
