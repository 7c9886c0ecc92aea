"""What makes a file job of `tmt translate` this job (OUT.tmt-job/job.json): its input's SHA-256,
the model's fingerprint, the decoding options that change what is written, the target prefixes'
and the glossary's SHA-256; read back (an earlier tmt's job filled in with the defaults of then),
and the first difference between two, named as the user would change it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformer_mt.common import files
from transformer_mt.config import Config, to_dict
from transformer_mt.translation import translate
from transformer_mt.translation.translate import Translator

JOB_FILE = "job.json"
JOB_FORMAT = 1
# Decoding options that do not change what is written: where, in what batches and with which
# kernels it runs.
NOT_IN_IDENTITY = ("device", "max_tokens", "buffer_lines", "cpu_linear", "cuda_graphs")


def identity_of(
    translator: Translator, source: Path, digest: str, prefix_digest: str | None
) -> dict[str, Any]:
    """What makes a job this job (job.json): its input, model, decoding options, prefixes."""
    decode = to_dict(translator.config)["decode"]
    identity = {
        "format": JOB_FORMAT,
        "input": str(source.resolve()),
        "input_sha256": digest,
        "model_sha256": translate.fingerprint(translator),
        "decode": {k: v for k, v in decode.items() if k not in NOT_IN_IDENTITY},
    }
    if prefix_digest is not None:  # a job without one keeps the identity of earlier tmt's jobs
        identity["prefix_sha256"] = prefix_digest
    if translator.glossary is not None:  # as the prefix: another glossary, another job
        settings = to_dict(translator.config)["glossary"]
        identity["glossary"] = {k: v for k, v in settings.items() if k != "path"}
        identity["glossary"]["sha256"] = translator.glossary.sha256
    return identity


def as_named_before(
    identity: dict[str, Any], before: dict[str, Any] | None, translator: Translator
) -> dict[str, Any]:
    """`identity`, named as an earlier tmt named this job's model where `before` (a job's
    recorded identity) did so: until 2026-11-29 a model decoding in bf16 or fp16 was named by
    its rounded weights, now by its float32 ones (translate.load_translator). Such a job is the
    same job: it resumes, or is found done, as before."""
    name = before.get("model_sha256") if before is not None else None
    if name == identity["model_sha256"] or not translate.named_before(translator, name):
        return identity
    return {**identity, "model_sha256": name}


def read_job(job_dir: Path) -> dict[str, Any] | None:
    path = job_dir / JOB_FILE
    if not path.exists():
        return None
    try:
        found = json.loads(files.read_plain(path, limit=1 << 20))
    except (OSError, ValueError, RecursionError):
        found = None
    if not _well_formed(found):
        return {"job.json": "unreadable"}
    # A decoding option that an earlier tmt did not have meant its default then (engine).
    defaults = {k: v for k, v in to_dict(Config())["decode"].items() if k not in NOT_IN_IDENTITY}
    found["decode"] = defaults | found["decode"]
    return found


# The fields of job.json, each with its type: every tmt wrote the first five; the rest only
# for a job that has one (a prefix, a glossary, a report).
_FIELDS = {"format": int, "input": str, "input_sha256": str, "model_sha256": str, "decode": dict}
_OPTIONAL = {"prefix_sha256": str, "glossary": dict, "glossary_report": bool}


def _well_formed(found: Any) -> bool:
    """Whether `found` reads as a job.json tmt writes: a field missing or of another type (a
    damaged file, or one tmt did not write) is no job's, refused as unreadable."""
    if not isinstance(found, dict):
        return False
    if not all(isinstance(found.get(key), kind) for key, kind in _FIELDS.items()):
        return False
    return all(isinstance(found[key], kind) for key, kind in _OPTIONAL.items() if key in found)


def difference(previous: dict[str, Any], identity: dict[str, Any]) -> str:
    if "job.json" in previous:
        return "an unreadable job.json"
    if previous.get("input_sha256") != identity["input_sha256"]:
        return f"another input ({previous.get('input')}, changed since or different)"
    if previous.get("prefix_sha256") != identity.get("prefix_sha256"):
        return "another target prefix file (--prefix), or none where there was one"
    if previous.get("glossary") != identity.get("glossary"):
        return "another glossary (--glossary) or glossary settings, or none where there was one"
    if previous.get("glossary_report") != identity.get("glossary_report"):
        return "a glossary report (--glossary-report) where there was none, or none where there was"
    old, new = previous.get("decode", {}), identity["decode"]
    changed = [f"decode.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k)]  # fmt: skip
    if changed:  # first: another engine or precision also makes another fingerprint
        return f"other decoding options ({', '.join(changed)})"
    if previous.get("model_sha256") != identity["model_sha256"]:
        return "another model"
    return "another format"
