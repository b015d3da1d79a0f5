"""Packed documents and sliding windows: train.py with document masking against plain causal attention, and the
attention core alone, on random documents of each length distribution; and at long sequences, documents of a
few hundred tokens and a window against plain causal attention, speed and peak memory."""
import os
import statistics
import time

from tools.bench.common import read_log, tokens_per_s, torchrun, write_json


def documents_part(settings, out):
    """'documents': the short sequences' rows (documents.json) and the long ones' (long_sequences.json),
    written and printed."""
    documents = documents_check(settings, out)
    write_json(os.path.join(out, "documents.json"), documents)
    for name, row in documents["rows"].items():
        print(f"documents {name:5s} ({row['documents_per_sequence']:.1f} a sequence): step time x"
              f"{row['step_time_ratio']:.2f} ({row['step_time_range'][0]:.2f}-{row['step_time_range'][1]:.2f}), "
              f"attention x{row['attention_time_ratio']:.2f} ({row['attention_time_range'][0]:.2f}-"
              f"{row['attention_time_range'][1]:.2f}) of plain causal's")
    long = long_sequences_check(settings, out)
    write_json(os.path.join(out, "long_sequences.json"), long)
    for name, row in long["rows"].items():
        low, high = row["speed_range"]
        print(f"long sequences {name}: tok/s {row['tokens_per_s']['causal']:,.0f} causal, "
              f"{row['tokens_per_s']['masked']:,.0f} masked (x{row['speed_ratio']:.2f}, {low:.2f}-{high:.2f}); "
              f"peak {row['peak_resident_bytes']['causal'] / 2**30:.2f} GiB causal, "
              f"{row['peak_resident_bytes']['masked'] / 2**30:.2f} GiB masked")


# Document length distributions: each document's length is geometric with this mean, in sequences.
DOCUMENT_LENGTHS = {"short": 1 / 8, "half": 1 / 2, "long": 2}


def packed_data(folder, seq_len, mean_sequences, vocab_size, n_tokens=1 << 18, seed=0):
    """A token directory (tools/prepare.py's layout) of random documents of geometric lengths (mean
    mean_sequences x seq_len tokens), each ended by the EOS id vocab_size - 1; returns the documents per
    sequence."""
    import numpy as np
    rng = np.random.default_rng(seed)
    lengths = rng.geometric(1 / max(2.0, mean_sequences * seq_len), n_tokens)
    ends = np.cumsum(lengths)
    ends = ends[ends <= n_tokens] - 1
    tokens = rng.integers(0, vocab_size - 1, n_tokens).astype(np.uint16)
    tokens[ends] = vocab_size - 1
    os.makedirs(folder, exist_ok=True)
    cut = n_tokens * 9 // 10
    tokens[:cut].tofile(os.path.join(folder, "train.bin"))
    tokens[cut:].tofile(os.path.join(folder, "val.bin"))
    write_json(os.path.join(folder, "meta.json"), dict(dtype="uint16", vocab_size=vocab_size, eos_id=vocab_size - 1))
    return len(ends) * seq_len / n_tokens


def attention_times(config, micro_batch, documents, rounds):
    """Seconds of one attention forward and backward (training's core on one device, cp.AttentionCore) within
    the documents and plain causal, alternated `rounds` times in this process: {arm: per round}."""
    import torch
    from cp import AttentionCore
    causal_attention = AttentionCore()
    head_dim = config.head_dim
    g = torch.Generator().manual_seed(0)
    q = torch.randn(micro_batch, config.n_head, config.seq_len, head_dim, generator=g, requires_grad=True)
    k, v = (torch.randn(micro_batch, config.n_kv_heads, config.seq_len, head_dim, generator=g, requires_grad=True)
            for _ in range(2))
    times = {"causal": [], "documents": []}
    for r in range(rounds + 1):  # the first to warm up
        for arm, given in [("causal", None), ("documents", documents)][::1 if r % 2 else -1]:  # order alternated
            start = time.perf_counter()
            causal_attention(q, k, v, given).sum().backward()
            if r:
                times[arm].append(time.perf_counter() - start)
    return times


def documents_check(settings, out):
    """train.py on one rank with --document-mask and with --no-document-mask, in turn in each round, on the
    same packed data, for each document length distribution: tokens per second, and model.py's attention
    core timed alone on the same micro-batches' documents; the median and range of the per-round ratios
    (masked over causal)."""
    from model import document_ids
    from training import cli
    from training.data import load_data
    steps, rounds = settings["scaling_steps"], settings["scaling_rounds"]
    args = cli.parse_args(["--model", settings["model"], "--arch", settings.get("arch", "gpt")])
    vocab = cli.PRESETS[settings["model"]]["vocab_size"]
    config = cli.model_config(args, vocab)
    micro_batch = settings["batch_size"] // settings["micro_batches"]
    rows = {}
    for name in settings["document_lengths"]:
        mean_sequences = DOCUMENT_LENGTHS[name]
        data = os.path.join(out, "documents", name)
        per_sequence = packed_data(data, config.seq_len, mean_sequences, vocab)
        common = ["--model", settings["model"], "--arch", settings.get("arch", "gpt"), "--data", data, "--batch-size",
                  str(settings["batch_size"]), "--micro-batches", str(settings["micro_batches"]), "--steps",
                  str(steps), "--eval-interval", str(steps), "--out", os.path.join(out, "documents", "runs")]
        per_round = []
        for r in range(rounds):
            print(f"bench: documents {name}, round {r + 1} of {rounds}", flush=True)
            speeds = {}
            for arm, flag in (("causal", "--no-document-mask"), ("documents", "--document-mask")):
                run = f"{name}-{arm}{r}"
                torchrun(1, "train.py", *common, flag, "--name", run)
                speeds[arm] = tokens_per_s(read_log(os.path.join(out, "documents", "runs", run, "log.jsonl"))[
                    settings["skip"]:])
            per_round.append(speeds)
        tokens = load_data(data, vocab).batch("train", 0, micro_batch, config.seq_len)[:, :-1]
        times = attention_times(config, micro_batch, document_ids(tokens, vocab - 1), max(3, rounds))
        step = [r["causal"] / r["documents"] for r in per_round]  # > 1: masking is slower
        attention = [d / c for c, d in zip(times["causal"], times["documents"])]
        rows[name] = dict(mean_document_sequences=mean_sequences, documents_per_sequence=per_sequence,
                          tokens_per_s={arm: statistics.median(r[arm] for r in per_round) for arm in per_round[0]},
                          step_time_ratio=statistics.median(step), step_time_range=[min(step), max(step)],
                          attention_s={arm: statistics.median(t) for arm, t in times.items()},
                          attention_time_ratio=statistics.median(attention),
                          attention_time_range=[min(attention), max(attention)])
    return dict(model=settings["model"], rounds=rounds, steps=steps, micro_batch=micro_batch, seq_len=config.seq_len,
                rows=rows)


def long_sequences_check(settings, out):
    """train.py on one rank at long sequences (settings["long_sequences"]: its rows), each row's masked run
    (--document-mask on packed documents of a mean length, or --sliding-window on the same data unmasked)
    beside plain causal attention (--no-document-mask) in alternated order in each round, on the same data:
    tokens per second and peak resident memory of each, the median and range of the rounds' speed ratios
    (masked over causal: above 1, faster)."""
    long, folder = settings["long_sequences"], os.path.join(out, "documents", "long")
    rows = {}
    for row in long["rows"]:
        name = f"seq {row['seq_len']} x{row['batch_size']}, " + (
            f"documents of {row['documents']}" if "documents" in row else f"window {row['window']} (unpacked)")
        data = os.path.join(folder, f"documents{row.get('documents', 256)}")
        per_sequence = packed_data(data, row["seq_len"], row.get("documents", 256) / row["seq_len"], 256,
                                   n_tokens=1 << 20)
        common = ["--model", long["model"], "--arch", long["arch"], "--data", data, "--seq-len", str(row["seq_len"]),
                  "--batch-size", str(row["batch_size"]), "--steps", str(long["steps"]), "--eval-interval",
                  str(long["steps"]), "--out", os.path.join(folder, "runs")]
        masked = ["--document-mask"] if "documents" in row else ["--no-document-mask", "--sliding-window",
                                                                 str(row["window"])]
        per_round = []
        for r in range(long["rounds"]):
            print(f"bench: long sequences, {name}, round {r + 1} of {long['rounds']}", flush=True)
            arms = [("causal", ["--no-document-mask"]), ("masked", masked)][::1 if r % 2 else -1]
            result = {}
            for arm, flags in arms:
                run = f"{len(rows)}-{arm}{r}"
                torchrun(1, "train.py", *common, *flags, "--name", run)
                log = read_log(os.path.join(folder, "runs", run, "log.jsonl"))
                result[arm] = dict(tokens_per_s=tokens_per_s(log[long["skip"]:]),
                                   peak_resident_bytes=max(e["peak_resident_bytes"][0] for e in log))
            per_round.append(result)
        speed = [r["masked"]["tokens_per_s"] / r["causal"]["tokens_per_s"] for r in per_round]
        rows[name] = dict(**row, documents_per_sequence=per_sequence if "documents" in row else None,
                          tokens_per_s={arm: statistics.median(r[arm]["tokens_per_s"] for r in per_round)
                                        for arm in ("causal", "masked")},
                          peak_resident_bytes={arm: max(r[arm]["peak_resident_bytes"] for r in per_round)
                                               for arm in ("causal", "masked")},
                          speed_ratio=statistics.median(speed), speed_range=[min(speed), max(speed)])
    return dict(model=long["model"], arch=long["arch"], rounds=long["rounds"], steps=long["steps"], rows=rows)
