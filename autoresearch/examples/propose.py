#!/usr/bin/env python3
"""An external proposer for `graphtrain search --proposer "python3 autoresearch/examples/propose.py"`.

It reads the search's state as JSON on stdin (`experiment`, `incumbent`, `incumbent_speed`,
`space` with its `knobs` and `rules`, `history` of earlier experiments with their `status`,
`pipeline`, `ratio` and estimated `speed`) and prints one pipeline in `--passes` form. The
search measures and decides; a proposer never grades its own result.

This one walks the incumbent's one-knob neighbours in knob order, skipping what was tried and
what breaks a rule; when none is left it changes two knobs, drawn from a generator seeded by
the experiment's number, so the same state gets the same answer.
"""
import json
import random
import sys


def pipeline(knobs, choice):
    parts = []
    for knob, i in zip(knobs, choice):
        if i == 0:  # `off` for a pass, `default` for a setting
            continue
        c = knob["choices"][i]
        bare = c == "on" and not knob.get("setting", False)
        parts.append(knob["pass"] if bare else f"{knob['pass']}={c}")
    return ",".join(parts) or "none"


def parse(knobs, text):
    choice = [0] * len(knobs)
    if text == "none":
        return choice
    for item in text.split(","):
        name, _, option = item.partition("=")
        k = next(i for i, knob in enumerate(knobs) if knob["pass"] == name)
        choices = knobs[k]["choices"]
        option = option or ("on" if "on" in choices else choices[1])
        choice[k] = choices.index(option)
    return choice


def valid(knobs, rules, choice):
    on = {knob["pass"] for knob, i in zip(knobs, choice) if i != 0}
    return all(r["Requires"]["needs"] in on for r in rules if "Requires" in r and r["Requires"]["pass"] in on)


def main():
    state = json.load(sys.stdin)
    knobs, rules = state["space"]["knobs"], state["space"]["rules"]
    tried = {h["pipeline"] for h in state["history"]} | {state["incumbent"]}
    incumbent = parse(knobs, state["incumbent"])
    for k, knob in enumerate(knobs):
        for i in range(len(knob["choices"])):
            c = list(incumbent)
            c[k] = i
            p = pipeline(knobs, c)
            if p not in tried and valid(knobs, rules, c):
                print(p)
                return
    rng = random.Random(state["experiment"])
    for _ in range(1000):
        c = list(incumbent)
        for k in rng.sample(range(len(knobs)), 2):
            c[k] = rng.randrange(len(knobs[k]["choices"]))
        p = pipeline(knobs, c)
        if p not in tried and valid(knobs, rules, c):
            print(p)
            return
    print(state["incumbent"])


if __name__ == "__main__":
    main()
