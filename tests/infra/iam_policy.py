"""The IAM policies infra/terraform renders, and what AWS decides for a request under them, without AWS.

`render(module, name, key, values)`: the JSON policy a `data "aws_iam_policy_document"` block of a module renders for
one key of its for_each, as the AWS provider writes it (Sid, Effect, Action, Resource, Principal, Condition), with
the module's variables (its defaults under `values`) and the data sources this module reads. Terraform's expressions
are evaluated for the subset the modules use: references (var., local., each., data., a dynamic block's iterator),
indexing, list literals, string templates, `a ? b : c`, `==`, and replace(); `$${` is Terraform's escape of an IAM
policy variable.

`decide(request, identity, resource=None)`: AWS's policy evaluation for one request (docs: "Policy evaluation logic",
"Condition operators", "Variables and tags", "Multivalued context keys"), for the elements these policies use:
- an explicit Deny in any policy wins; else an Allow in the identity policy (or in the resource policy, for a
  principal it names) allows; else the request is implicitly denied;
- Action / NotAction: case-insensitive, `*` and `?` wildcards; Resource: `*` and `?` wildcards, policy variables
  `${key}` replaced by the request's context value, and a statement whose variable has no value in the request does
  not apply (AWS: "not present ... causes the statement to be invalid");
- Principal (resource and trust policies): an ARN matches that principal; an account's root ARN matches any principal
  of that account, which then also needs its own identity policy's Allow (delegation to the account);
- Condition: every operator, every key of it and (OR) any of its values; String(Not)Equals, String(Not)Like,
  Arn(Not)Equals/Like (colon-separated parts matched one by one), Bool, Null, the ...IfExists suffix and the
  ForAllValues: / ForAnyValue: qualifiers; a key missing from the request makes a condition false, a negated one
  true, an IfExists one true, ForAllValues true and ForAnyValue false; keys are case-insensitive, values are not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.infra.test_terraform import _blocks, _locals, _resources

ACCOUNT = "123456789012"
REGION = "us-east-1"
DATA = {"aws_region": {"current": {"name": REGION}}, "aws_partition": {"current": {"partition": "aws"}},
        "aws_caller_identity": {"current": {"account_id": ACCOUNT}}}


# ----------------------------------------------------------------------------------------------- Terraform, rendered
class _Expr:
    """A recursive-descent evaluator of the Terraform expressions the modules' policy documents use."""

    TOKEN = re.compile(r'\s*(\?|:|==|\[|\]|\(|\)|,|\.|"(?:[^"\\]|\\.)*"|[A-Za-z_][A-Za-z0-9_-]*|\d+)')

    def __init__(self, text: str, scope: "Scope"):
        self.tokens, self.scope, self.i = self._lex(text), scope, 0

    def _lex(self, text: str) -> list[str]:
        tokens, pos = [], 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            match = self.TOKEN.match(text, pos)
            if match is None:
                raise ValueError(f"cannot read Terraform expression {text!r} at {pos}")
            tokens.append(match.group(1))
            pos = match.end()
        return tokens

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.tokens[self.i]
        if expected is not None and token != expected:
            raise ValueError(f"expected {expected!r}, got {token!r} in {self.tokens}")
        self.i += 1
        return token

    def value(self):
        result = self.ternary()
        if self.peek() is not None:
            raise ValueError(f"unread tokens {self.tokens[self.i:]}")
        return result

    def ternary(self):
        condition = self.equality()
        if self.peek() != "?":
            return condition
        self.take("?")
        yes = self.ternary()
        self.take(":")
        no = self.ternary()
        return yes if condition else no

    def equality(self):
        left = self.postfix()
        while self.peek() == "==":
            self.take("==")
            left = left == self.postfix()
        return left

    def postfix(self):
        value = self.primary()
        while self.peek() in (".", "["):
            if self.take() == ".":
                value = self.scope.resolve(value[self.take()])
            else:
                index = self.ternary()
                self.take("]")
                value = self.scope.resolve(value[index])
        return value

    def primary(self):
        token = self.take()
        if token == "[":
            items = []
            while self.peek() != "]":
                items.append(self.ternary())
                if self.peek() == ",":
                    self.take(",")
            self.take("]")
            return items
        if token == "(":
            inner = self.ternary()
            self.take(")")
            return inner
        if token.startswith('"'):
            return self.scope.template(token[1:-1].replace('\\"', '"'))
        if token in ("true", "false"):
            return token == "true"
        if token.isdigit():
            return int(token)
        if self.peek() == "(":  # a function call
            self.take("(")
            args = []
            while self.peek() != ")":
                args.append(self.ternary())
                if self.peek() == ",":
                    self.take(",")
            self.take(")")
            if token == "replace":
                return args[0].replace(args[1], args[2])
            raise ValueError(f"function {token}() is not evaluated here")
        return self.scope.names[token]  # resolved member by member (postfix): locals refer to locals


class _Done(str):
    """A string already evaluated (what it holds, `${aws:...}` included, is text, never read again)."""


def _plain(value):
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, str) else value


@dataclass
class Scope:
    """What a module's expressions refer to: var, local, each, data, a dynamic block's iterator."""

    names: dict = field(default_factory=dict)

    def resolve(self, value):
        """A value from the HCL, its templates evaluated (locals are evaluated where they are used)."""
        if isinstance(value, _Done):
            return value
        if isinstance(value, str):
            return self.template(value)
        if isinstance(value, list):
            return [self.resolve(v) for v in value]
        if isinstance(value, dict):
            return {k: self.resolve(v) for k, v in value.items() if not k.startswith("__")}
        return value

    def template(self, text: str):
        """A string template: one `${expr}` alone is its value (a list, a bool); else the interpolated string, with
        Terraform's escape `$${` read as a literal `${`."""
        pieces, pos, values = [], 0, []
        while (start := text.find("${", pos)) != -1:
            if start > 0 and text[start - 1] == "$":  # $${ ... }: an escaped, literal ${
                pieces.append(text[pos:start - 1] + "${")
                pos = start + 2
                continue
            depth, end = 0, start + 2
            while end < len(text):
                depth += {"{": 1, "}": -1}.get(text[end], 0)
                if depth < 0:
                    break
                end += 1
            value = _Expr(text[start + 2:end], self).value()
            values.append(value)
            pieces.append(text[pos:start])
            pieces.append(value)
            pos = end + 1
        pieces.append(text[pos:])
        pieces = [p for p in pieces if not (isinstance(p, str) and p == "")]
        if len(values) == 1 and len(pieces) == 1 and pieces[0] is values[0]:
            return values[0]
        return _Done("".join(str(p).lower() if isinstance(p, bool) else str(p) for p in pieces))


def render(module: Path, name: str, key: str, values: dict) -> dict:
    """The JSON policy `data "aws_iam_policy_document" "<name>"` of `module` renders for `each.key == key`."""
    variables = {n: b.get("default") for n, b in _blocks(module, "variable").items()}
    variables.update(values)
    scope = Scope({"var": variables, "local": _locals(module), "data": DATA})
    body = _resources(module, "data")[("aws_iam_policy_document", name)]
    if "for_each" in body:
        scope.names["each"] = {"key": key, "value": scope.resolve(body["for_each"])[key]}
    statements = [_statement(s, scope) for s in body.get("statement", [])]
    for dynamic in body.get("dynamic", []):
        for label, block in dynamic.items():
            assert label == "statement", label
            for index, item in enumerate(scope.resolve(block["for_each"])):
                inner = Scope({**scope.names, "statement": {"key": index, "value": item}})
                statements += [_statement(s, inner) for s in block["content"]]
    return {"Version": "2012-10-17", "Statement": statements}


def _statement(block: dict, scope: Scope) -> dict:
    out = _plain_statement(block, scope)
    return {k: ({op: {key: _plain(v) for key, v in keys.items()} for op, keys in out[k].items()} if k == "Condition"
                else {t: _plain(v) for t, v in out[k].items()} if k == "Principal" else _plain(out[k])) for k in out}


def _plain_statement(block: dict, scope: Scope) -> dict:
    out = {"Effect": scope.resolve(block.get("effect", "Allow"))}
    if "sid" in block:
        out["Sid"] = scope.resolve(block["sid"])
    for hcl, json_name in (("actions", "Action"), ("not_actions", "NotAction"), ("resources", "Resource"),
                           ("not_resources", "NotResource")):
        if hcl in block:
            out[json_name] = list(scope.resolve(block[hcl]))
    for principal in block.get("principals", []):
        out.setdefault("Principal", {})[scope.resolve(principal["type"])] = scope.resolve(principal["identifiers"])
    for condition in block.get("condition", []):
        test, variable = scope.resolve(condition["test"]), scope.resolve(condition["variable"])
        out.setdefault("Condition", {}).setdefault(test, {})[variable] = scope.resolve(condition["values"])
    return out


# ----------------------------------------------------------------------------------------------- AWS, evaluated
@dataclass
class Request:
    """One request: who makes it (`principal`: a role's ARN, `account`), what (`action`) on what (`resource`), and
    its context keys (aws:PrincipalTag/..., s3:if-match, aws:TagKeys, ...; a list for a multivalued key)."""

    principal: str
    action: str
    resource: str
    context: dict = field(default_factory=dict)

    @property
    def account(self) -> str:
        return self.principal.split(":")[4]

    def get(self, key: str):
        """The context value of `key` (keys are case-insensitive), None when the request has none."""
        found = {k.lower(): v for k, v in {"aws:PrincipalArn": self.principal, **self.context}.items()}
        return found.get(key.lower())


class _Unresolved(Exception):
    """A policy variable with no value in the request: the statement does not apply."""


def _substitute(pattern: str, request: Request) -> str:
    def value(match: re.Match) -> str:
        found = request.get(match.group(1))
        if found is None or isinstance(found, list):
            raise _Unresolved(match.group(1))
        return found
    return re.sub(r"\$\{([^}]+)\}", value, pattern)


def _glob(pattern: str, value: str, case: bool = True) -> bool:
    """`*` any run of characters, `?` one character, nothing else special."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, 0 if case else re.IGNORECASE) is not None


def _arn_like(pattern: str, value: str) -> bool:
    """ArnLike: the six colon-separated parts matched one by one (the last part keeps its colons)."""
    p, v = pattern.split(":", 5), value.split(":", 5)
    return len(p) == len(v) == 6 and all(_glob(a, b) for a, b in zip(p, v))


_MATCHERS = {
    "StringEquals": lambda p, v: p == v, "StringLike": _glob, "ArnEquals": _arn_like, "ArnLike": _arn_like,
    "Bool": lambda p, v: p.lower() == str(v).lower(),
}
_NEGATED = {"StringNotEquals": "StringEquals", "StringNotLike": "StringLike", "ArnNotEquals": "ArnEquals",
            "ArnNotLike": "ArnLike"}


def _condition(operator: str, key: str, values: list[str], request: Request) -> bool:
    found = request.get(key)
    if operator == "Null":
        return (found is None) == (str(values[0]).lower() == "true")
    qualifier, _, operator = operator.rpartition(":")
    if_exists = operator.endswith("IfExists")
    operator = operator.removesuffix("IfExists")
    negated = operator in _NEGATED
    match = _MATCHERS[_NEGATED.get(operator, operator)]
    patterns = [_substitute(v, request) if operator not in ("Bool",) else v for v in values]
    if qualifier == "ForAllValues":
        return all(any(match(p, v) for p in patterns) for v in (found or []))
    if qualifier == "ForAnyValue":
        return any(any(match(p, v) for p in patterns) for v in (found or []))
    if found is None:
        return if_exists or negated
    hit = any(match(p, found) for p in patterns)
    return not hit if negated else hit


def _applies(statement: dict, request: Request, resource_policy: bool) -> bool:
    try:
        if "Action" in statement and not any(_glob(a, request.action, case=False) for a in statement["Action"]):
            return False
        if "NotAction" in statement and any(_glob(a, request.action, case=False) for a in statement["NotAction"]):
            return False
        if "Resource" in statement and not any(_glob(_substitute(r, request), request.resource)
                                               for r in statement["Resource"]):
            return False
        if resource_policy and not _names(statement.get("Principal", {}), request):
            return False
        return all(_condition(operator, key, list(values) if isinstance(values, list) else [values], request)
                   for operator, keys in statement.get("Condition", {}).items() for key, values in keys.items())
    except _Unresolved:
        return False


def _names(principal: dict, request: Request) -> bool:
    """Whether a resource policy's Principal names the requester: its ARN, or its account's root."""
    arns = principal.get("AWS", [])
    arns = [arns] if isinstance(arns, str) else arns
    return any(arn == request.principal or arn == f"arn:aws:iam::{request.account}:root" for arn in arns)


def decide(request: Request, identity: dict, resource: dict | None = None) -> str:
    """"Deny" (an explicit Deny applies), "Allow" or "ImplicitDeny" for `request` under the identity policy of its
    principal and, where the request is to a resource with a policy (a role's trust policy), that policy. A resource
    policy that names the principal's account, not the principal, allows only with the identity policy's Allow too."""
    policies = [(identity, False)] + ([(resource, True)] if resource is not None else [])
    applying = [(s, is_resource) for policy, is_resource in policies for s in policy["Statement"]
                if _applies(s, request, is_resource)]
    if any(s["Effect"] == "Deny" for s, _ in applying):
        return "Deny"
    by_identity = any(s["Effect"] == "Allow" for s, is_resource in applying if not is_resource)
    if resource is None:
        return "Allow" if by_identity else "ImplicitDeny"
    by_resource = [s for s, is_resource in applying if is_resource and s["Effect"] == "Allow"]
    named = [[a] if isinstance(a, str) else a for a in (s["Principal"].get("AWS") or [] for s in by_resource)]
    if any(request.principal in arns for arns in named):
        return "Allow"  # the principal itself is named: the resource policy alone allows
    return "Allow" if by_resource and by_identity else "ImplicitDeny"
