"""A ValidatingAdmissionPolicy and its binding (admissionregistration.k8s.io/v1) evaluated as the Kubernetes API
server evaluates them, on a real CEL evaluator (cel-python's celpy), for what cannot run here (an API server).

What the API server does, in its order (Kubernetes' validating admission policy dispatcher; the behaviour its docs
state, kubernetes.io/docs/reference/access-authn-authz/validating-admission-policy):
- the policy applies to a request when one of its matchConstraints.resourceRules names the request's group, version,
  resource and operation, and the binding's matchResources.namespaceSelector the labels of the request's namespace;
- then every matchCondition is evaluated: one that is false skips the policy; an error (and none false) is decided by
  failurePolicy (Fail: the request is refused);
- `variables` are evaluated lazily, in order, each seeing the ones before it; an error in one surfaces only where it
  is used (here: each variable is evaluated once, and an error is kept as the variable's value, which celpy carries
  as an error into every expression that uses it, as CEL's error values do);
- every validation must be true; false refuses the request with the validation's messageExpression (when it
  evaluates to a one-line string), else its message, else "failed expression: <expression>"; an error is decided by
  failurePolicy;
- the binding's validationActions say what a refusal does: Deny refuses the request.
At run time the API server hands `object`, `oldObject` (null on CREATE; `object` is null on DELETE) and `request`
(the AdmissionRequest: operation, kind, resource, name, namespace, userInfo) to CEL as plain maps, so presence is
asked with has() and `in`, as here. `params` is null (the policy has no paramKind); `authorizer` is not modelled
(a policy that uses it fails here with an undeclared reference, never silently).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import celpy
import celpy.celtypes
from celpy.evaluation import CELEvalError

from components.cluster.kube import PLURALS

ENV = celpy.Environment()


@functools.lru_cache(maxsize=None)
def _program(expression: str):
    return ENV.program(ENV.compile(expression))


def evaluate(expression: str, activation: dict):
    """The expression's value (a celpy value), or the CELEvalError it evaluated to."""
    try:
        return _program(expression).evaluate(activation)
    except CELEvalError as exc:
        return exc


def _cel(value):
    return celpy.json_to_cel(value)


@dataclass
class Request:
    """An admission request: what `request`, `object` and `oldObject` are to the policy."""

    operation: str  # CREATE, UPDATE or DELETE
    object: Optional[dict]
    old_object: Optional[dict] = None
    username: str = "system:serviceaccount:rlhf:rlhf-actor"
    pod: Optional[str] = None  # the pod the request's token is bound to (userInfo.extra)
    namespace: str = "rlhf"

    @property
    def subject(self) -> dict:
        return self.object if self.object is not None else self.old_object

    def as_cel(self) -> dict:
        subject = self.subject
        group, _, version = subject["apiVersion"].rpartition("/")
        resource = PLURALS[(subject["apiVersion"], subject["kind"])]
        groups = ["system:serviceaccounts", f"system:serviceaccounts:{self.namespace}", "system:authenticated"]
        user = {"username": self.username, "uid": "uid-of-" + self.username, "groups": groups}
        if self.pod is not None:
            user["extra"] = {"authentication.kubernetes.io/pod-name": [self.pod],
                             "authentication.kubernetes.io/pod-uid": ["uid-of-" + self.pod]}
        return {"operation": self.operation, "kind": {"group": group, "version": version, "kind": subject["kind"]},
                "resource": {"group": group, "version": version, "resource": resource},
                "name": subject["metadata"]["name"], "namespace": self.namespace, "userInfo": user, "dryRun": False}


@dataclass
class Decision:
    allowed: bool
    applied: bool  # whether the policy matched the request at all
    messages: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        return ("admitted" if self.allowed else "refused") + (f": {'; '.join(self.messages)}" if self.messages else "")


def _rule_matches(rule: dict, group: str, version: str, resource: str, operation: str) -> bool:
    def has(values, value):
        return "*" in values or value in values
    return (has(rule.get("apiGroups", []), group) and has(rule.get("apiVersions", []), version)
            and has(rule.get("resources", []), resource) and has(rule.get("operations", []), operation))


def _selector_matches(selector: Optional[dict], labels: dict) -> bool:
    """A label selector (matchLabels and matchExpressions In/NotIn/Exists/DoesNotExist); an absent one matches all."""
    if not selector:
        return True
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, operator, values = expression["key"], expression["operator"], expression.get("values") or []
        if not {"In": lambda: labels.get(key) in values, "NotIn": lambda: labels.get(key) not in values,
                "Exists": lambda: key in labels, "DoesNotExist": lambda: key not in labels}[operator]():
            return False
    return True


class AdmissionPolicy:
    """A ValidatingAdmissionPolicy with its binding (no params)."""

    def __init__(self, policy: dict, binding: dict):
        assert policy["kind"] == "ValidatingAdmissionPolicy" and binding["kind"] == "ValidatingAdmissionPolicyBinding"
        assert binding["spec"]["policyName"] == policy["metadata"]["name"]
        assert "paramKind" not in policy["spec"], "params are not modelled"
        self.spec, self.binding = policy["spec"], binding["spec"]
        for entry in (self.spec.get("matchConditions", []) + self.spec.get("variables", [])
                      + self.spec.get("validations", [])):  # every expression compiles, as the API server requires
            _program(entry["expression"])
            if "messageExpression" in entry:
                _program(entry["messageExpression"])

    def applies(self, request: Request, namespace_labels: dict) -> bool:
        cel = request.as_cel()
        resource, operation = cel["resource"], request.operation
        constraints = self.spec["matchConstraints"]
        if not any(_rule_matches(r, resource["group"], resource["version"], resource["resource"], operation)
                   for r in constraints.get("resourceRules", [])):
            return False
        if any(_rule_matches(r, resource["group"], resource["version"], resource["resource"], operation)
               for r in constraints.get("excludeResourceRules", [])):
            return False
        selectors = [constraints.get("namespaceSelector"),
                     self.binding.get("matchResources", {}).get("namespaceSelector")]
        return all(_selector_matches(s, namespace_labels) for s in selectors)

    def admit(self, request: Request, namespace_labels: Optional[dict] = None) -> Decision:
        """What the API server decides on `request` in a namespace labelled `namespace_labels` (by default the
        labels Kubernetes gives every namespace: kubernetes.io/metadata.name)."""
        labels = {"kubernetes.io/metadata.name": request.namespace} if namespace_labels is None else namespace_labels
        if not self.applies(request, labels):
            return Decision(True, False)
        fail = self.spec.get("failurePolicy", "Fail") == "Fail"
        deny = "Deny" in self.binding["validationActions"]
        activation = {"object": _cel(request.object), "oldObject": _cel(request.old_object),
                      "request": _cel(request.as_cel()), "params": _cel(None),
                      "namespaceObject": _cel({"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": request.namespace, "labels": labels}})}
        errors = []
        for condition in self.spec.get("matchConditions", []):
            value = evaluate(condition["expression"], activation)
            if isinstance(value, CELEvalError):
                errors.append(f"matchCondition {condition['name']}: {value.args[0]}")
            elif not value:
                return Decision(True, False)
        if errors:
            return Decision(not (fail and deny), True, errors)
        variables = {}
        for variable in self.spec.get("variables", []):
            variables[variable["name"]] = evaluate(variable["expression"],
                                                   {**activation, "variables": _variables(variables)})
        activation["variables"] = _variables(variables)
        messages = []
        for validation in self.spec["validations"]:
            value = evaluate(validation["expression"], activation)
            if isinstance(value, CELEvalError):
                if fail:
                    messages.append(f"expression '{validation['expression']}' resulted in error: {value.args[0]}")
            elif not value:
                messages.append(_message(validation, activation))
        return Decision(not (messages and deny), True, messages)


def _variables(values: dict):
    return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})


def _message(validation: dict, activation: dict) -> str:
    if "messageExpression" in validation:
        text = evaluate(validation["messageExpression"], activation)
        if not isinstance(text, CELEvalError) and isinstance(text, str) and text.strip() and "\n" not in text:
            return str(text)
    return validation.get("message") or f"failed expression: {validation['expression']}"
