#!/usr/bin/env python3
"""One layer's training step under several kernel settings side by side: runs
profile_layer.py once per setting and round (a setting is a list of VAR=VALUE environment
assignments, such as the BIE_CUDA_* switches that choose a kernel form; "" is the default),
alternating the settings round after round, and prints each run's kernel table, then a summary
of the JSON lines: bie's step, PyTorch's in the same process, their ratio, and bie's step
against the first setting's in the same round.

    BIE_LIBRARY=build-gpu/libbie.so PYTHONPATH=python python3 python/bench/forms.py \\
        --rounds 2 --layer q4linear --size 4096 -- "" BIE_CUDA_Q4_QUOTIENT=1 \\
        "BIE_CUDA_Q4_QUOTIENT=1 BIE_CUDA_Q4_XVALUES=1"

Arguments before "--" go to profile_layer.py (besides --rounds and --timeout); the settings
follow it. The last line is JSON: every run's setting, round and numbers."""

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def parse_setting(text):
    """{VAR: VALUE} of a setting such as "A=1 B=0"; ValueError on a word without "="."""
    env = {}
    for word in text.split():
        name, eq, value = word.partition("=")
        if not eq or not name:
            raise ValueError(f"forms: not VAR=VALUE: {word!r}")
        env[name] = value
    return env


def split_args(argv):
    """(rounds, timeout, profile_layer's arguments, settings) of the command line."""
    if "--" not in argv:
        raise ValueError("forms: the settings follow \"--\"")
    cut = argv.index("--")
    own, settings = argv[:cut], argv[cut + 1:]
    if not settings:
        raise ValueError("forms: no setting after \"--\"")
    rounds, timeout, rest = 1, 300, []
    i = 0
    while i < len(own):
        if own[i] in ("--rounds", "--timeout") and i + 1 < len(own):
            value = int(own[i + 1])
            if value < 1:
                raise ValueError(f"forms: {own[i]} must be at least 1")
            rounds, timeout = (value, timeout) if own[i] == "--rounds" else (rounds, value)
            i += 2
        else:
            rest.append(own[i])
            i += 1
    for s in settings:
        parse_setting(s)
    return rounds, timeout, rest, settings


def run_one(script, args, setting, timeout):
    """The JSON line of one profile_layer run (None if it gave none), after printing its output."""
    env = dict(os.environ)
    env.update(parse_setting(setting))
    try:
        done = subprocess.run([sys.executable, str(script), *args], env=env, text=True,
                              capture_output=True, timeout=timeout)
        out = done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or "") if isinstance(e.stdout, str) else ""
        out += f"\nforms: timed out after {timeout} s\n"
    print(out, end="" if out.endswith("\n") else "\n", flush=True)
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def main(argv=None, script=HERE / "profile_layer.py"):
    try:
        rounds, timeout, args, settings = split_args(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    runs = []
    for r in range(rounds):
        for s in settings:
            print(f"== round {r + 1}, setting {s or '(default)'}", flush=True)
            runs.append({"round": r + 1, "setting": s, "result": run_one(script, args, s, timeout)})
    print(f"{'setting':<48} {'round':>5} {'bie µs':>9} {'torch µs':>9} {'ratio':>6} {'vs first':>8}")
    for run in runs:
        res = run["result"] or {}
        first = next((x["result"] for x in runs
                      if x["round"] == run["round"] and x["setting"] == settings[0]), None) or {}
        bie_us, torch_us = res.get("bie_graph_us"), res.get("torch_bf16_graph_us")
        rel = (first["bie_graph_us"] / bie_us) if bie_us and first.get("bie_graph_us") else None

        def cell(v, fmt):
            return format(v, fmt) if v is not None else "-"

        print(f"{(run['setting'] or '(default)')[:48]:<48} {run['round']:>5} "
              f"{cell(bie_us, '9.1f')} {cell(torch_us, '9.1f')} "
              f"{cell(res.get('ratio'), '6.3f')} {cell(rel, '8.3f')}")
    print(json.dumps({"bench": "forms", "runs": runs}), flush=True)
    return 0 if all(run["result"] for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
