"""A run's S3 credentials reach its own store only (infra/terraform/modules/iam, components/storage/s3.py): the IAM
policies the module renders, evaluated as AWS evaluates them (tests/infra/iam_policy.py) for the requests a run's
store makes. A session tagged run=A writes and deletes in A's store and in nothing of B's (checkpoints, lease,
latest.json); an untagged session writes no run's store; the critic writes only its own run's pending saves; leases,
latest.json and commit points move only by conditional writes; a role assumes itself again only with exactly a run
tag, and no other role can. The evaluator itself is checked against cases AWS's documentation spells out."""

from __future__ import annotations

import pytest

from components.storage.s3 import RUN_TAG
from tests.infra.iam_policy import ACCOUNT, Request, decide, render
from tests.infra.test_terraform import ENV_DEV, MODULES, _blocks

IAM = MODULES / "iam"
BUCKET = "arn:aws:s3:::dev-artifacts"
VALUES = {"name_prefix": "dev", "cluster_name": "dev", "bucket_arn": BUCKET,
          "oidc_provider_arn": f"arn:aws:iam::{ACCOUNT}:oidc-provider/oidc.eks.us-east-1.amazonaws.com/id/X",
          "oidc_issuer_url": "https://oidc.eks.us-east-1.amazonaws.com/id/X",
          "kms_key_arn": f"arn:aws:kms:us-east-1:{ACCOUNT}:key/k",
          "store_key_secret_arn": f"arn:aws:secretsmanager:us-east-1:{ACCOUNT}:secret:dev-store-key-abc"}
STORES = "rlhf/checkpoints"  # the module's default checkpoint_prefix, where every run's store is: <it>/<run name>/
ROLE = {role: f"arn:aws:iam::{ACCOUNT}:role/dev-{role}-pod" for role in ("actor", "critic")}
CONDITIONAL = {"create": {"s3:if-none-match": "*"}, "replace": {"s3:if-match": '"etag"'}, "plain": {}}


def policy(role: str) -> dict:
    return render(IAM, "s3", role, VALUES)


def s3(role: str, action: str, key: str, run: str | None, **context) -> str:
    """What AWS decides for `action` on s3://<bucket>/<key> by `role`'s session (tagged run=<run>, or untagged)."""
    tags = {f"aws:PrincipalTag/{RUN_TAG}": run} if run else {}
    return decide(Request(ROLE[role], action, f"{BUCKET}/{key}", {**tags, **context}), policy(role))


# What a run's store writes (components/storage/store.py, lease.py; the critic server's put_dir)
def writes_of(run: str) -> list[tuple[str, str, dict]]:
    store = f"{STORES}/{run}"
    return [("s3:PutObject", f"{store}/iter_3-7-0a1b2c3d/actor/model.safetensors", CONDITIONAL["plain"]),
            ("s3:PutObject", f"{store}/iter_3-7-0a1b2c3d/state.json", CONDITIONAL["create"]),
            ("s3:PutObject", f"{store}/latest.json", CONDITIONAL["replace"]),
            ("s3:PutObject", f"{store}/latest.json", CONDITIONAL["create"]),
            ("s3:PutObject", f"{store}/lease.json", CONDITIONAL["create"]),
            ("s3:PutObject", f"{store}/lease.json", CONDITIONAL["replace"]),
            ("s3:PutObject", f"{store}/control/handoff.json", CONDITIONAL["plain"]),
            ("s3:DeleteObject", f"{store}/iter_1-2-0a1b2c3d/actor/model.safetensors", {}),
            ("s3:DeleteObject", f"{store}/lease.json", {"s3:if-match": '"etag"'}),
            ("s3:DeleteObject", f"{store}/latest.json", {})]


def test_a_runs_credentials_write_and_delete_its_own_store():
    decided = {(action, key): s3("actor", action, key, "run-a", **context)
               for action, key, context in writes_of("run-a")}
    assert set(decided.values()) == {"Allow"}, decided


def test_a_runs_credentials_cannot_write_or_delete_another_runs_checkpoints_lease_or_latest_json():
    decided = {(action, key): s3("actor", action, key, "run-a", **context)
               for action, key, context in writes_of("run-b")}
    assert "Allow" not in decided.values(), decided
    # nor by a name that only starts like its own, nor by a path that climbs out of its own
    assert s3("actor", "s3:PutObject", f"{STORES}/run-ab/latest.json", "run-a", **CONDITIONAL["replace"]) != "Allow"
    assert s3("actor", "s3:PutObject", f"{STORES}/run-a-x/lease.json", "run-a", **CONDITIONAL["create"]) != "Allow"


def test_an_untagged_session_writes_no_runs_store():
    """The pod's own IRSA session (no run tag): ${aws:PrincipalTag/run} has no value, so the statement that grants a
    run's store does not apply; what it may write is the pipelines' stage leases."""
    for run in ("run-a", "run-b"):
        assert "Allow" not in {s3("actor", action, key, None, **context) for action, key, context in writes_of(run)}
    assert s3("actor", "s3:PutObject", f"{STORES}/locks/sft-0123456789abcdef0123", None, **CONDITIONAL["create"]) \
        == "Allow"
    assert s3("actor", "s3:GetObject", f"{STORES}/run-b/model/model.safetensors", None) == "Allow"  # reads stay open


def test_the_critic_writes_only_its_own_runs_pending_saves():
    assert s3("critic", "s3:PutObject", f"{STORES}/run-a/critic-pending/step-4/critic_state.pt", "run-a") == "Allow"
    assert s3("critic", "s3:DeleteObject", f"{STORES}/run-a/critic-pending/step-4.sha256.json", "run-a") == "Allow"
    assert s3("critic", "s3:PutObject", f"{STORES}/run-b/critic-pending/step-4/critic_state.pt", "run-a") != "Allow"
    decided = {s3("critic", action, key, "run-a", **context) for action, key, context in writes_of("run-a")}
    assert "Allow" not in decided  # never a checkpoint, a lease or latest.json, even of its own run
    assert s3("critic", "s3:PutObject", f"{STORES}/locks/sft-0123456789abcdef0123", "run-a") != "Allow"
    read_only = render(IAM, "s3", "critic", {**VALUES, "critic_read_only": True})
    assert decide(Request(ROLE["critic"], "s3:PutObject", f"{BUCKET}/{STORES}/run-a/critic-pending/x",
                          {f"aws:PrincipalTag/{RUN_TAG}": "run-a"}), read_only) == "ImplicitDeny"


@pytest.mark.parametrize("name", ["latest.json", "lease.json", "iter_3-7-0a1b2c3d/state.json"])
def test_a_runs_own_records_move_only_by_conditional_writes(name: str):
    """latest.json (the store's sequence) and a lease: If-Match or If-None-Match; a commit point: If-None-Match."""
    key = f"{STORES}/run-a/{name}"
    assert s3("actor", "s3:PutObject", key, "run-a") == "Deny"
    assert s3("actor", "s3:PutObject", key, "run-a", **CONDITIONAL["create"]) == "Allow"
    replaced = s3("actor", "s3:PutObject", key, "run-a", **CONDITIONAL["replace"])
    assert replaced == ("Deny" if name.endswith("state.json") else "Allow")


def assume(caller: str, target: str, tags: dict[str, str], caller_arn: str | None = None) -> str:
    """What AWS decides for `caller`'s session calling sts:AssumeRole (and sts:TagSession, with tags) on `target`'s
    role: both actions must be allowed, by the caller's identity policy and the target's trust policy."""
    trust = render(IAM, "irsa_assume", target, VALUES)
    context = {**{f"aws:RequestTag/{k}": v for k, v in tags.items()}, **({"aws:TagKeys": list(tags)} if tags else {})}
    actions = ["sts:AssumeRole"] + (["sts:TagSession"] if tags else [])
    decided = {decide(Request(caller_arn or ROLE[caller], action, ROLE[target], context), policy(caller), trust)
               for action in actions}
    return "Allow" if decided == {"Allow"} else ("Deny" if "Deny" in decided else "ImplicitDeny")


def test_a_role_assumes_itself_again_only_with_exactly_a_run_tag():
    for role in ("actor", "critic"):
        assert assume(role, role, {RUN_TAG: "run-a"}) == "Allow"
        assert assume(role, role, {}) != "Allow"  # no run tag: the session it would give writes nothing anyway
        assert assume(role, role, {RUN_TAG: ""}) != "Allow"
        assert assume(role, role, {RUN_TAG: "run-a", "team": "x"}) != "Allow"  # only the run tag
    assert assume("critic", "actor", {RUN_TAG: "run-a"}) != "Allow"  # never another role's rights
    assert assume("actor", "critic", {RUN_TAG: "run-a"}) != "Allow"
    stranger = f"arn:aws:iam::{'9' * 12}:role/dev-actor-pod"  # the same name in another account
    assert assume("actor", "actor", {RUN_TAG: "run-a"}, caller_arn=stranger) != "Allow"


def test_the_store_key_is_readable_by_the_pod_roles_and_wired_from_the_bucket_module():
    for role in ("actor", "critic"):
        assert decide(Request(ROLE[role], "secretsmanager:GetSecretValue", VALUES["store_key_secret_arn"]),
                      policy(role)) == "Allow"
        assert decide(Request(ROLE[role], "secretsmanager:GetSecretValue",
                              f"arn:aws:secretsmanager:us-east-1:{ACCOUNT}:secret:other"), policy(role)) != "Allow"
    module = _blocks(ENV_DEV, "module")
    assert module["iam"]["store_key_secret_arn"] == "${module.artifacts.store_key_secret_arn}"


# ------------------------------------------------------------------------------------ the evaluator, against AWS's docs
def test_the_evaluator_decides_as_awss_documentation_says():
    """Cases spelled out in AWS's IAM docs: a Deny wins over an Allow; a policy variable with no value makes its
    statement not apply; a negated operator is true for a missing key, a positive one false; Null tests presence;
    ForAllValues is true for a missing key and ForAnyValue false; ...IfExists is true for a missing key; actions
    match case-insensitively, resources with wildcards; ArnLike matches part by part."""
    home = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject"],
         "Resource": [f"{BUCKET}/home/${{aws:username}}/*"]},
        {"Effect": "Deny", "Action": ["s3:PutObject"], "Resource": [f"{BUCKET}/home/*/locked/*"]}]}
    user = f"arn:aws:iam::{ACCOUNT}:user/David"
    assert decide(Request(user, "S3:putobject", f"{BUCKET}/home/David/a", {"aws:username": "David"}), home) == "Allow"
    assert decide(Request(user, "s3:PutObject", f"{BUCKET}/home/Adele/a", {"aws:username": "David"}),
                  home) == "ImplicitDeny"
    assert decide(Request(user, "s3:PutObject", f"{BUCKET}/home/David/a", {}), home) == "ImplicitDeny"
    assert decide(Request(user, "s3:PutObject", f"{BUCKET}/home/David/locked/a", {"aws:username": "David"}),
                  home) == "Deny"

    def one(operator: str, key: str, values: list[str], context: dict) -> str:
        statement = {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": ["*"],
                     "Condition": {operator: {key: values}}}
        return decide(Request(user, "s3:GetObject", f"{BUCKET}/x", context), {"Statement": [statement]})

    assert one("StringEquals", "aws:PrincipalTag/job", ["admin"], {}) == "ImplicitDeny"
    assert one("StringNotLike", "aws:PrincipalTag/job", ["admin"], {}) == "Allow"
    assert one("StringNotEqualsIfExists", "aws:PrincipalTag/job", ["admin"], {}) == "Allow"
    assert one("StringLikeIfExists", "aws:PrincipalTag/job", ["adm*"],
               {"aws:PrincipalTag/job": "user"}) == "ImplicitDeny"
    assert one("Null", "aws:TokenIssueTime", ["true"], {}) == "Allow"
    assert one("Null", "aws:TokenIssueTime", ["false"], {}) == "ImplicitDeny"
    assert one("ForAllValues:StringEquals", "aws:TagKeys", ["run"], {}) == "Allow"
    assert one("ForAnyValue:StringEquals", "aws:TagKeys", ["run"], {}) == "ImplicitDeny"
    assert one("ForAllValues:StringEquals", "aws:TagKeys", ["run"], {"aws:TagKeys": ["run", "team"]}) == "ImplicitDeny"
    assert one("StringLike", "AWS:principaltag/job", ["?*"], {"aws:PrincipalTag/job": "x"}) == "Allow"
    assert one("StringEquals", "aws:PrincipalTag/job", ["Admin"], {"aws:PrincipalTag/job": "admin"}) == "ImplicitDeny"
    assert one("StringEquals", "s3:prefix", ["home/${aws:username}/"], {"s3:prefix": "home/David/",
                                                                       "aws:username": "David"}) == "Allow"
    pattern, value = "arn:aws:someservice:*:111122223333:finance/*", \
        "arn:aws:someservice:us-east-2:999999999999:store/abc:111122223333:finance/document.txt"
    assert one("StringLike", "aws:SourceArn", [pattern], {"aws:SourceArn": value}) == "Allow"
    assert one("ArnLike", "aws:SourceArn", [pattern], {"aws:SourceArn": value}) == "ImplicitDeny"
