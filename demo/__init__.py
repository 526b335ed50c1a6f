"""tierps.demo: `tierps demo`, a DeepFM CTR model trained through a local cluster.

- `tierps.demo.data`: MovieLens-100k (read from the recbole package) and a Criteo-like
  synthetic set, as batches of CSR bags (numpy only).
- `tierps.demo.deepfm`: DeepFM in torch with a pluggable embedding layer: tables on the
  cluster (tierps.client.torch) or local torch.nn.EmbeddingBag tables (the baseline).
- `tierps.demo.training`: the reusable pieces: the models built over either embedding
  layer, the training loop, evaluation and its metrics.
- `tierps.demo.main`: the command (`run(args)`).
- `tierps.demo.trainers`: `tierps demo --trainers N`, its torchrun launch and one rank.

Needs the `torch` extra; the data module needs only numpy.
"""
