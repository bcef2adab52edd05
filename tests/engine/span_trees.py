"""A span tree in canonical form: what must stay equal when the way spans are built changes.

Ids, timestamps and durations differ from run to run; names, kinds, parents, links, events
and the other attributes of the same workload must not. Spans are named by what they are
(a request's id, a step's id, a phase's name and ordinal), never by their random ids.
"""

from __future__ import annotations

from sightline.instrumentation import semconv as sc

# attributes whose values are measured times: present, but their values vary per run
VOLATILE = frozenset({sc.REQUEST_TTFT_S, sc.REQUEST_TPOT_S, sc.REQUEST_QUEUE_S, sc.REQUEST_E2E_S})
# which process recorded a span: a fact of the deployment, asserted by tests of their own
PROCESS_IDENTITY = frozenset({sc.PROCESS_ROLE, sc.PROCESS_PID})


def _value(value):
    return list(value) if isinstance(value, tuple) else value


def _attributes(attributes) -> dict:
    return {k: ("<volatile>" if k in VOLATILE else _value(v)) for k, v in sorted(attributes.items())
            if k not in PROCESS_IDENTITY}


def canonical_tree(spans) -> list[dict]:
    """Spans of requests (server + phases) and engine steps, each named by its meaning."""
    names: dict[int, str] = {}
    for s in spans:
        if s.name == sc.SPAN_ENGINE_STEP:
            names[s.context.span_id] = f"step:{s.attributes[sc.STEP_ID]}"
        elif sc.REQUEST_ID in (s.attributes or {}):
            names[s.context.span_id] = f"request:{s.attributes[sc.REQUEST_ID]}"
    ordinal: dict[tuple[str, str], int] = {}
    for s in sorted(spans, key=lambda s: s.start_time):
        if s.context.span_id in names or s.parent is None:
            continue
        parent = names.get(s.parent.span_id, "?")
        key = (parent, s.name)
        ordinal[key] = ordinal.get(key, 0) + 1
        names[s.context.span_id] = f"{parent}/{s.name}#{ordinal[key]}"
    tree = []
    for s in spans:
        tree.append({
            "span": names.get(s.context.span_id, s.name),
            "name": s.name,
            "kind": s.kind.name,
            "parent": None if s.parent is None else names.get(s.parent.span_id, "<remote>"),
            "links": [names.get(link.context.span_id, "?") for link in s.links],
            "events": [[e.name, _attributes(e.attributes or {})] for e in s.events],
            "status": s.status.status_code.name,
            "attributes": _attributes(s.attributes or {}),
        })
    return sorted(tree, key=lambda span: span["span"])
