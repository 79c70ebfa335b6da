"""`make llama-check` (opt-in): llama.cpp serves our exported head as we do.

    python -m training.export.llama_check [--prompts 6] [--new-tokens 96] [--threads 1]
        [--llama-server PATH] [--out runs/llama-check]

On the float32 GGUF of the embedded target (its blocks dequantized, written once into the cache:
llama.cpp's f32 path is where its batched verify and its steps agree) llama-server runs plain and
with the shipped head (`-md HEAD --spec-type draft-eagle3 --spec-draft-n-max 3`); specstop runs
the same target dequantized (`SPECSTOP_QUANT=0`, fp32) with `ar` and `sd --gamma 3 --stop fixed`
(llama.cpp's chain of 3). The contract (exit 1 when broken): llama.cpp + head writes llama.cpp
plain's greedy text on every held-out prompt. Reported beside it: where llama.cpp's text equals
ours, whether it accepted as many draft tokens as we did; tokens per second of each row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from decoding import models
from decoding.bench.config import BenchConfig, load_prompts
from decoding.bench.llama import LlamaServer, find_server
from decoding.bench.report import write_atomic
from decoding.options import add_option

HEAD = Path(__file__).resolve().parents[2] / "checkpoints" / "drafts" / "smollm2-135m-eagle3"


def write_f32_gguf(src: Path, out: Path) -> Path:
    """`src` with every tensor in float32 (quantized ones dequantized by the gguf package), the
    metadata as it is; atomic. Kept: a later check reuses it."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, dequantize

    if out.is_file():
        return out
    r = GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.tmp-")
    os.close(fd)
    try:
        w = GGUFWriter(tmp, arch)
        for name, f in r.fields.items():
            if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
                continue
            if f.types[0] == GGUFValueType.ARRAY:
                w.add_key_value(name, f.contents(), GGUFValueType.ARRAY, f.types[-1])
            else:
                w.add_key_value(name, f.contents(), f.types[0])
        w.add_uint32("general.file_type", 0)  # all float32
        for t in r.tensors:
            w.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def check(prompts: int, new_tokens: int, threads: int, server: str | None, progress=print) -> dict:
    import torch

    from decoding.api import Decoder

    from training.export.gguf_head import export_gguf

    binary = find_server(server)
    work = models.cache_root() / "llama-check"
    target = write_f32_gguf(models.smollm2_gguf_path(), work / "smollm2-135m-instruct-f32.gguf")
    head = export_gguf(HEAD, work / "head-f32.gguf", target)
    os.environ["SPECSTOP_QUANT"] = "0"  # ours: the dequantized fp32 target, llama.cpp's f32 file
    torch.set_num_threads(threads)
    ar = Decoder.load(None, dtype="float32", strategy="ar")
    sd = ar.variant("sd", gamma=3, stop="fixed")
    todo = [(k, r) for k, f in BenchConfig().prompt_sets.items() for r in load_prompts(f, prompts)]
    rows = []
    with LlamaServer(binary, target, threads) as plain, LlamaServer(binary, target, threads, head=head) as spec:
        for kind, row in todo:
            a, b = plain.chat(row["prompt"], new_tokens), spec.chat(row["prompt"], new_tokens)
            ours = ar.generate(row["prompt"], new_tokens, chat=True)
            ours_sd = sd.generate(row["prompt"], new_tokens, chat=True)
            rows.append({"kind": kind, "id": row["id"], "head_equals_plain": a["text"].strip() == b["text"].strip(),
                         "llama_equals_ours": a["text"].strip() == ours.text.strip(),
                         "llama_drafted": b.get("draft_n", 0), "llama_accepted": b.get("draft_accepted", 0),
                         "ours_drafted": ours_sd.stats["drafted"], "ours_accepted": ours_sd.stats["accepted"],
                         "tok_s": {"llama.cpp": a["tokens"] / a["wall_s"], "llama.cpp+head": b["tokens"] / b["wall_s"]}})
            r = rows[-1]
            progress(f"{kind} {row['id']}: head == plain {r['head_equals_plain']}, llama == ours "
                     f"{r['llama_equals_ours']}, accepted llama {r['llama_accepted']} / ours {r['ours_accepted']}")
    same = [r for r in rows if r["llama_equals_ours"]]
    return {"rows": rows, "threads": threads, "new_tokens": new_tokens, "target": target.name,
            "contract_holds": all(r["head_equals_plain"] for r in rows),
            "same_text": len(same), "same_accepted": sum(r["llama_accepted"] == r["ours_accepted"] for r in same)}


def markdown(res: dict, command: str) -> str:
    n = len(res["rows"])
    lines = [f"# llama-check: llama.cpp serves our head ({res['target']}, {res['threads']} thread(s))", "",
             f"Command: `{command}`", "",
             f"- Contract, llama.cpp + head greedy == llama.cpp plain: **{'holds' if res['contract_holds'] else 'BROKEN'}** "
             f"({sum(r['head_equals_plain'] for r in res['rows'])}/{n} prompts).",
             f"- llama.cpp's text equals ours (fp32) on {res['same_text']}/{n}; there it accepted as many draft "
             f"tokens as our `sd --gamma 3 --stop fixed` on {res['same_accepted']}/{res['same_text']}.", "",
             "| prompt | head == plain | llama == ours | llama drafted / accepted | ours drafted / accepted |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['kind']} {r['id']} | {r['head_equals_plain']} | {r['llama_equals_ours']} | "
              f"{r['llama_drafted']} / {r['llama_accepted']} | {r['ours_drafted']} / {r['ours_accepted']} |"
              for r in res["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.export.llama_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(ap, "prompts", default=6)
    add_option(ap, "new_tokens", default=96)
    add_option(ap, "threads", default=1)
    add_option(ap, "llama_server")
    add_option(ap, "out", default="runs/llama-check")
    a = ap.parse_args(argv)
    command = "python -m training.export.llama_check " + " ".join(argv if argv is not None else sys.argv[1:])
    try:
        res = check(a.prompts, a.new_tokens, a.threads, a.llama_server,
                    progress=lambda m: print(m, file=sys.stderr, flush=True))
    except (ValueError, models.ModelError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out)
    write_atomic(out / "results.json", json.dumps(res, indent=2))
    md = markdown(res, command)
    write_atomic(out / "results.md", md)
    print(md)
    return 0 if res["contract_holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
