"""A DLRM exported by ``dlrmflow export --to torchrec``, loaded into TorchRec 1.8.0's ``DLRM``: its predictions
against dlrmflow's on ROWS rows (issue 44, item 3).

The run: ``--run-dir`` (a finished DLRM run, scored on its own dataset), or else the Criteo Kaggle DLRM (sparse
dim 16, bottom 13-512-256-64-16, top 367-512-256-1) trained ITERATIONS batches on synthetic Criteo rows
(``bench_data.synthetic_dataset``). It is exported (``export_run``, as the command does), a TorchRec
``DLRM`` is built from ``export.json``'s constructor arguments and loads ``model.pt`` with ``strict=True``;
both score the dataset's first ROWS rows in batches of 4096 (dlrmflow evaluate's default): dlrmflow with
``dlrmflow.load_model(RUN_DIR).predict``, TorchRec with a ``KeyedJaggedTensor`` of one id per feature.

Printed: the first rows side by side, how many probabilities are bit-equal, the largest difference of the
probabilities and of the logits, and the same comparison stage by stage (the embeddings as TorchRec's
``SparseArch`` returns them, the dense arch's output, the interaction's values, the logits), which locates
any difference. Exit status 1 when a probability differs by more than TOLERANCE.

TorchRec cannot be installed into the project's environment (its requirement ``fbgemm-gpu`` resolves to the
CUDA build 1.9.0, which does not import beside torch 2.13): run this in a virtualenv of its own that sees
the project's packages (docs/export.md):

    .venv/bin/python -m venv --system-site-packages /tmp/trvenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/trvenv/lib/python3.11/site-packages/dlrmflow.pth
    /tmp/trvenv/bin/pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 tensordict==0.15.3 \\
        torchmetrics==1.0.3 pyre-extensions==0.0.32 lightning-utilities==0.15.3 pyvers==0.2.3 tqdm
    /tmp/trvenv/bin/python benchmarks/torchrec_export.py [--rows 10000] [--run-dir RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

BATCH = 4096  # dlrmflow evaluate's default batch size
# Probabilities within this of each other count as the same prediction: a float32 probability near 0.3 has
# a spacing of 3e-8; the over arch's first layer sums its inputs in another order in TorchRec (docs/export.md).
TOLERANCE = 1e-6


def _torchrec_model(export_dir: Path) -> torch.nn.Module:
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    arguments = json.loads((export_dir / "export.json").read_text())["torchrec"]
    tables = [EmbeddingBagConfig(name=t["name"], feature_names=t["feature_names"], num_embeddings=t["num_embeddings"],
                                 embedding_dim=t["embedding_dim"], pooling=PoolingType[t["pooling"]])
              for t in arguments["tables"]]
    model = DLRM(embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("cpu")),
                 dense_in_features=arguments["dense_in_features"],
                 dense_arch_layer_sizes=arguments["dense_arch_layer_sizes"],
                 over_arch_layer_sizes=arguments["over_arch_layer_sizes"])
    model.load_state_dict(torch.load(export_dir / "model.pt", weights_only=True), strict=True)
    return model.eval()


def _features(names: list[str], sparse: np.ndarray):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    # Feature-major values, one id per row and feature.
    values = torch.from_numpy(sparse.T.reshape(-1).astype(np.int64))
    return KeyedJaggedTensor.from_lengths_sync(keys=names, values=values,
                                               lengths=torch.ones(sparse.size, dtype=torch.int32))


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def compare(run_dir: Path, rows: int, work: Path) -> int:
    import dlrmflow
    from dlrmflow.engine.batch_stream import BatchStream
    from dlrmflow.engine.training.model_export import export_run, interaction_permutation

    ours = dlrmflow.load_model(run_dir)
    export_dir = work / "export"
    result = export_run(run_dir, export_dir)
    print(f"exported {run_dir} -> {export_dir}: {result['tables']} tables, {result['embedding_rows']:,} rows of "
          f"{result['embedding_dim']}, {result['bytes'] / 2**20:.1f} MiB in {result['seconds']:.1f} s")
    theirs = _torchrec_model(export_dir)
    names = list(ours.features.sparse)
    stream = BatchStream(ours.features.dataset, BATCH, stop_row=rows)
    probs = {"dlrmflow": [], "torchrec": []}
    logits = {"dlrmflow": [], "torchrec": []}
    stages = {"embeddings": True, "dense arch": True, "interaction": True, "top MLP in TorchRec's order": True}
    triu = torch.from_numpy(ours.config.embedding_dim + interaction_permutation(ours.num_tables))
    with torch.no_grad():
        for batch in stream:
            probs["dlrmflow"].append(ours.predict(batch))
            dense = torch.tensor(batch.dense)
            ids = batch.sparse.astype(np.int64) + np.asarray(ours.table_offsets)[None, :]
            our_embeddings = torch.from_numpy(ours.rows[ids.reshape(-1)][:, : ours.dim]).view(len(ids), -1, ours.dim)
            logits["dlrmflow"].append(ours.model(dense, our_embeddings))
            features = _features(names, batch.sparse)
            their_embeddings = theirs.sparse_arch(features)
            stages["embeddings"] &= _bits_equal(their_embeddings, our_embeddings)
            their_x = theirs.dense_arch(dense)
            stages["dense arch"] &= _bits_equal(their_x, ours.model.bottom(dense))
            their_interaction = theirs.inter_arch(their_x, their_embeddings)
            our_interaction = ours.model.interact(ours.model.bottom(dense), our_embeddings)
            dim = ours.config.embedding_dim
            ordered = torch.cat([our_interaction[:, :dim], our_interaction.index_select(1, triu)], 1)
            stages["interaction"] &= _bits_equal(their_interaction, ordered)
            their_logits = theirs(dense, features).squeeze(1)
            # dlrmflow's own top MLP, its first layer's inputs and weight columns in TorchRec's order: the same
            # products summed in TorchRec's order.
            first, *rest = [m for m in ours.model.top]
            weight = torch.cat([first.weight[:, :dim], first.weight.index_select(1, triu)], 1)
            reordered = torch.nn.functional.linear(ordered, weight, first.bias)
            stages["top MLP in TorchRec's order"] &= _bits_equal(torch.nn.Sequential(*rest)(reordered).squeeze(1),
                                                                 their_logits)
            logits["torchrec"].append(their_logits)
            probs["torchrec"].append(torch.sigmoid(their_logits).numpy())
    p = {k: np.concatenate(v) for k, v in probs.items()}
    z = {k: torch.cat(v) for k, v in logits.items()}
    equal = int(np.count_nonzero(p["dlrmflow"].view(np.int32) == p["torchrec"].view(np.int32)))
    prob_diff = float(np.abs(p["dlrmflow"].astype(np.float64) - p["torchrec"]).max())
    logit_diff = float((z["dlrmflow"].double() - z["torchrec"].double()).abs().max())
    print(f"\n{'row':>5} {'dlrmflow':>12} {'torchrec':>12} {'difference':>12}")
    for i in range(min(8, len(p["dlrmflow"]))):
        a, b = p["dlrmflow"][i], p["torchrec"][i]
        print(f"{i:>5} {a:12.9f} {b:12.9f} {float(a) - float(b):12.3e}")
    print(f"\n{len(p['dlrmflow']):,} rows: {equal:,} probabilities bit-equal; largest difference "
          f"{prob_diff:.3e} (probability), {logit_diff:.3e} (logit)")
    print("stage by stage, bit-equal: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in stages.items()) +
          f", logits {'yes' if _bits_equal(z['dlrmflow'], z['torchrec']) else 'no'}")
    print(f"tolerance {TOLERANCE:g}: {'within' if prob_diff <= TOLERANCE else 'EXCEEDED'}")
    return 0 if prob_diff <= TOLERANCE else 1


def synthetic_run(work: Path, rows: int, iterations: int) -> Path:
    """The Criteo Kaggle DLRM trained ``iterations`` batches on ``rows`` synthetic rows (reused when present)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_data import synthetic_dataset

    from dlrmflow.engine.training.config import TrainConfig
    from dlrmflow.engine.training.job import train

    dataset = synthetic_dataset(work / f"data-{rows}", rows, 0.01)
    run_dir = work / f"run-{rows}-{iterations}"
    if not (run_dir / "summary.json").is_file():
        train(TrainConfig(dataset_dir=str(dataset), mode="local", output_dir=str(run_dir), batch_size=BATCH,
                          iterations=iterations, eval_fraction=0.0, metrics_every=iterations))
    return run_dir


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000, help="rows compared")
    parser.add_argument("--run-dir", type=Path, default=None, help="a finished DLRM run (default: train one)")
    parser.add_argument("--iterations", type=int, default=20, help="training iterations of the trained run")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "dlrmflow-bench-torchrec")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # TorchRec's import warns about optional GPU modules it does not find
    import torchrec

    args.work.mkdir(parents=True, exist_ok=True)
    run_dir = args.run_dir or synthetic_run(args.work, max(args.rows, BATCH * args.iterations), args.iterations)
    print(f"torchrec {torchrec.__version__ if hasattr(torchrec, '__version__') else '?'}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores ({platform.machine()}); run {run_dir}")
    return compare(run_dir, args.rows, args.work)


if __name__ == "__main__":
    raise SystemExit(main())
