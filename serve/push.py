"""Push an exported draft to the Hugging Face Hub, with a model card that says where it came from.

``serve push`` uploads the draft directory (config.json, weights, provenance.json: what the export
writes; any other file there is refused) in one commit whose README.md is built here: the export's
own card with Hub metadata on top (licence, base model, tags), then the data lineage (feature store,
table and version, feature-set identity), the licences the manifest gives its sources, and the AL
table of ``evaluate al`` when its report measured this very directory. The repo is created when
missing (``serve.hub_visibility``), the branch too (``serve.hub_revision``).

The token comes from HF_TOKEN or the saved login (``huggingface_hub.get_token``) and goes only to
the client's Authorization header: it is never printed, logged, or written to a file. The
trade-off: one ``create_commit`` with an explicit list of ``CommitOperationAdd`` instead of
``upload_folder``, so exactly what is sent is decided (and tested) here; the client still decides
how each file travels (inline, LFS or Xet).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import typing
from pathlib import Path
from typing import Any

from eaglenest.engine import MAX_NUM_SPECULATIVE_TOKENS, draft_family
from eaglenest.errors import EaglenestError
from eaglenest.paths import read_json_object, shown_path
from eaglenest.serve import formats
from eaglenest.serve.draft_files import check_draft_dir

log = logging.getLogger(__name__)

#: Hub licence ids the card's metadata may name directly; any other licence is "other".
HUB_LICENCES = frozenset({"apache-2.0", "mit", "cc0-1.0", "cc-by-4.0", "cc-by-sa-4.0", "cc-by-nc-4.0",
                          "cc-by-nc-sa-4.0", "cc-by-3.0", "bsd-2-clause", "bsd-3-clause", "mpl-2.0", "gpl-3.0",
                          "lgpl-3.0", "agpl-3.0", "odc-by", "odbl", "pddl", "unlicense", "llama3.1", "gemma"})
#: What ``serve push`` sends from the draft folder: what ``serve export`` writes there (its ``EXPORT_FILES``;
#: README.md is rebuilt for the Hub). Any other file in the folder is refused, never published.
PUSHED_FILES = frozenset({"config.json", "model.safetensors", "provenance.json", "README.md"})
#: The draft families' names in the commit message (the card's tag is the family itself).
FAMILY_NAMES = {"eagle3": "EAGLE-3", "peagle": "P-EAGLE", "dflash": "DFlash"}


@dataclasses.dataclass(frozen=True)
class PushPlan:
    """Everything one push sends: where, and which files (``path_in_repo`` -> local path or bytes)."""

    repo_id: str
    revision: str
    private: bool
    files: dict[str, Path | bytes]
    commit_message: str

    @property
    def card(self) -> str:
        return self.files["README.md"].decode("utf-8")


def resolve_token() -> str:
    """HF_TOKEN, else the saved login; a clear error when there is neither."""
    from huggingface_hub import get_token

    token = get_token()  # HF_TOKEN first, trimmed as the client trims it: "hf_x\n" from a file is hf_x
    if not token:
        raise EaglenestError("serve push: no Hugging Face token: set HF_TOKEN or log in with `hf auth login`")
    return token


def plan_push(draft_dir: str | Path, *, repo_id: str, revision: str = "main", visibility: str = "private",
              licences: dict[str, str], manifest_name: str = "", report: dict | None = None) -> PushPlan:
    """The commit for ``draft_dir``: its files and the card. ``licences``: source -> licence."""
    draft = Path(draft_dir)
    if not (draft / "config.json").is_file():
        raise EaglenestError(f"serve push: no exported draft at {draft}: run `serve export` first")
    extra = sorted(p.name for p in draft.iterdir() if not p.name.startswith(".") and p.name not in PUSHED_FILES)
    if extra:  # a note, a log, a link to a secret elsewhere: published with the draft, and public repos exist
        raise EaglenestError(f"serve push: {shown_path(draft / extra[0])} is not part of the export (only "
                             f"{', '.join(sorted(PUSHED_FILES))} are pushed): nothing pushed; move it out of "
                             "the folder")
    check_draft_dir(draft)  # weights whole, vocabulary map consistent: never push a draft vLLM cannot load
    if not (draft / "provenance.json").is_file():  # the card's lineage would be all blanks
        raise EaglenestError(f"serve push: {shown_path(draft / 'provenance.json')} is missing: the model card's "
                             "lineage comes from it; export the draft again (`serve export`)")
    prov = read_json_object(draft / "provenance.json", error=EaglenestError,
                            then="export the draft again (`serve export`)")
    if not isinstance(prov.get("inputs") or {}, dict):
        raise EaglenestError(f"{shown_path(draft / 'provenance.json')}: inputs: not an object; "
                             "export the draft again (`serve export`)")
    if prov.get("format", "vllm") not in typing.get_args(formats.Format):  # it becomes a tag in the card's YAML
        raise EaglenestError(f"{shown_path(draft / 'provenance.json')}: format: {str(prov['format'])[:60]!r} is not "
                             f"one of {', '.join(typing.get_args(formats.Format))}; export the draft again (`serve export`)")
    files: dict[str, Path | bytes] = {name: draft / name for name in sorted(PUSHED_FILES - {"README.md"})
                                      if (draft / name).is_file()}
    card_in = (draft / "README.md").read_text(encoding="utf-8") if (draft / "README.md").is_file() else ""
    if report is not None and Path(str(report.get("draft", ""))).resolve() != draft.resolve():
        log.info("evaluate report measured %s, not %s: no AL table in the card", report.get("draft"), draft)
        report = None
    family = draft_family(read_json_object(draft / "config.json", error=EaglenestError,
                                           then="export the draft again (`serve export`)"))
    files["README.md"] = card(card_in, prov, licences=licences, manifest_name=manifest_name,
                              report=report, family=family).encode("utf-8")
    inputs = prov.get("inputs") or {}
    message = (f"eaglenest {FAMILY_NAMES[family]} draft ({prov.get('format', 'vllm')} format, "
               f"step {inputs.get('step')})")
    return PushPlan(repo_id=repo_id, revision=revision, private=visibility == "private", files=files,
                    commit_message=message)


def read_report(path: str | Path) -> dict | None:
    """``evaluate al``'s report.json for the card's AL table (None: there is none); a damaged one is
    one line naming the file and the key."""
    path = Path(path)
    if not path.is_file():
        return None
    then = "run `evaluate al` again (or remove it)"
    report = read_json_object(path, error=EaglenestError, then=then)
    rows = report.get("domains") or {}
    if not isinstance(rows, dict):
        raise EaglenestError(f"{shown_path(path)}: domains: not an object; {then}")
    rows = {**{f"domains.{k}": v for k, v in rows.items()}, "overall": report.get("overall") or {}}
    for key, row in rows.items():
        if not isinstance(row, dict):
            raise EaglenestError(f"{shown_path(path)}: {key}: not an object; {then}")
        for name in ("prompts", "acceptance_length", "acceptance_length_per_request"):
            if row.get(name) is not None and not _number(row[name]):
                raise EaglenestError(f"{shown_path(path)}: {key}.{name}: not a number; {then}")
        pos = row.get("acceptance_by_position")
        if pos is not None and not (isinstance(pos, list) and all(x is None or _number(x) for x in pos)):
            raise EaglenestError(f"{shown_path(path)}: {key}.acceptance_by_position: not a list of numbers; {then}")
    k = report.get("num_speculative_tokens")
    # as many as evaluate.num_speculative_tokens allows (vLLM verifies at most MAX_NUM_SPECULATIVE_TOKENS a round)
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_NUM_SPECULATIVE_TOKENS):
        raise EaglenestError(f"{shown_path(path)}: num_speculative_tokens: not a count of draft tokens; {then}")
    if not isinstance(report.get("lossless", {}), dict):
        raise EaglenestError(f"{shown_path(path)}: lossless: not an object; {then}")
    return report


def _number(x) -> bool:
    """A finite number: json reads NaN and Infinity, which the card would publish as a measurement."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and (isinstance(x, int) or math.isfinite(x))


def push_draft(plan: PushPlan, *, token: str, endpoint: str | None = None) -> str:
    """Create the repo (and branch) if needed and commit ``plan``; returns the commit URL."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi(endpoint=endpoint, token=token)
    ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=data if isinstance(data, bytes) else str(data))
           for name, data in plan.files.items()]
    try:
        _create_repo(api, plan)
        if plan.revision != "main":
            api.create_branch(plan.repo_id, branch=plan.revision, repo_type="model", exist_ok=True)
        info = api.create_commit(plan.repo_id, ops, commit_message=plan.commit_message, revision=plan.revision,
                                 repo_type="model")
    except HfHubHTTPError as exc:  # one line; the client's messages carry no token
        raise EaglenestError(f"serve push: the Hub refused ({str(exc).splitlines()[0]})") from None
    except Exception as exc:  # transport errors: the client's HTTP library (httpx/httpx2) or the OS
        if not (isinstance(exc, OSError) or type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "requests")):
            raise
        raise EaglenestError(f"serve push: cannot reach the Hub at {api.endpoint}: {exc}") from None
    log.info("pushed %d files to %s@%s", len(ops), plan.repo_id, plan.revision)
    return info.commit_url


def _create_repo(api, plan: PushPlan) -> None:
    """Create the repo at ``plan``'s visibility; one that exists must be private when the push is
    (``create_repo`` leaves an existing repo's visibility as it is: a private push would go public)."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        api.create_repo(plan.repo_id, private=plan.private, repo_type="model")
        return
    except HfHubHTTPError as exc:  # 409: it exists; 401-403: no right to create, maybe to push
        if exc.response is None or exc.response.status_code not in (401, 402, 403, 409):
            raise
        refused = exc
    try:
        private = api.repo_info(plan.repo_id, repo_type="model").private
    except HfHubHTTPError:  # not there to read either: why it could not be created is the error
        raise refused from None
    if plan.private and not private:
        raise EaglenestError(f"serve.hub_visibility: private, but {plan.repo_id} exists and is public: nothing "
                             "pushed; make the repo private on the Hub or set serve.hub_visibility=public")


def card(card_in: str, prov: dict[str, Any], *, licences: dict[str, str], manifest_name: str,
         report: dict | None, family: str = "eagle3") -> str:
    """The Hub card: metadata (``family``, the draft's: eagle3, peagle or dflash, a tag), the export's
    card, lineage, licence and (when measured) AL."""
    inputs = prov.get("inputs") or {}
    target = str(inputs.get("target", ""))
    distinct = sorted(set(licences.values()))
    meta = ["---", f"license: {_hub_licence(distinct)}"]
    if len(distinct) != 1 or distinct[0].lower() not in HUB_LICENCES:
        meta.append(f"license_name: {_slug('-'.join(distinct) or 'unknown')}")
    if re.fullmatch(r"[\w.-]+/[\w.-]+", target) and not Path(target).exists():  # a Hub id, not a local path
        meta.append(f"base_model: {target}")
    meta += ["tags:", f"- {family}", "- speculative-decoding", "- eaglenest", f"- {prov.get('format', 'vllm')}",
             "---", ""]
    lineage = ["## Data and lineage", "", "| | |", "|---|---|",
               f"| target | `{target}` |",
               f"| manifest | `{manifest_name}` |" if manifest_name else None,
               f"| feature store | `{inputs.get('store_uri')}` |",
               f"| features table | `{inputs.get('table')}` version {inputs.get('version')} |",
               f"| feature set | `{inputs.get('feature_set_id') or 'n/a'}` |",
               f"| draft checkpoint | step {inputs.get('step')} |",
               f"| code version | `{prov.get('code_version', 'n/a')}` |"]
    if inputs.get("feature_identity"):
        try:
            identity = json.dumps(json.loads(inputs["feature_identity"]), indent=2, sort_keys=True)
        except (TypeError, ValueError):
            raise EaglenestError("provenance.json: inputs.feature_identity: not JSON text; "
                                 "export the draft again (`serve export`)") from None
        lineage += ["", "Feature-set identity (what the stored hidden states depend on):", "", "```json",
                    identity, "```"]
    lic = ["## Licence", "",
           "Prompt sources and their licences, from the manifest:", "",
           *[f"- `{src}`: {name}" for src, name in sorted(licences.items())], "",
           "The responses the draft was trained on were generated by the target, whose own licence terms "
           "apply as well."]
    body = [card_in.rstrip(), "", *(x for x in lineage if x is not None), "", *_al_table(report), *lic]
    return "\n".join(meta + body) + "\n"


def _al_table(report: dict | None) -> list[str]:
    if not report:
        return []
    k = int(report.get("num_speculative_tokens") or 0)
    rows = [*report.get("domains", {}).items(), ("**overall**", report.get("overall") or {})]
    head = ["group", "prompts", "AL pooled", "AL per-request", *[f"pos {i + 1}" for i in range(k)]]
    out = [f"## Acceptance length (vLLM, `evaluate al`, {k} draft tokens, temperature "
           f"{report.get('temperature')})", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, d in rows:
        pos = [*(d.get("acceptance_by_position") or []), *[None] * k][:k]
        # A group is a manifest domain or a prompt file's category, any text: one cell, a "|" escaped, line breaks
        # as spaces (as evaluate's report.md writes it; serve may not import evaluate).
        cells = [" ".join(str(name).replace("|", "\\|").split()), d.get("prompts"), d.get("acceptance_length"),
                 d.get("acceptance_length_per_request"), *pos]
        out.append("| " + " | ".join("-" if c is None else f"{c:.3f}" if isinstance(c, float) else str(c)
                                     for c in cells) + " |")
    if "lossless" in report:
        ll = report["lossless"]
        out += ["", f"Lossless check: {ll.get('identical')}/{ll.get('prompts')} greedy outputs token-for-token "
                    "identical to the target's alone."]
    return out + [""]


def _hub_licence(distinct: list[str]) -> str:
    return distinct[0].lower() if len(distinct) == 1 and distinct[0].lower() in HUB_LICENCES else "other"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.-]+", "-", text.lower()).strip("-") or "unknown"
