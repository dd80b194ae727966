#!/usr/bin/env python3
"""Checks deploy/ without a cloud: what can be checked here, is.

- Terraform (deploy/gcp/terraform): every file parses as HCL2 (python-hcl2); every `var.X`,
  `local.X` and resource reference `TYPE.NAME` resolves to a declaration; the enclave image is
  referenced by a digest-checked variable; the bucket keeps public access prevention and a
  lifecycle rule on contributions; no front-end role can delete objects.
- Kubernetes (deploy/gcp/k8s): every document has apiVersion, kind and metadata.name; every
  container has resource requests, no privilege escalation, a read-only root filesystem and drops
  all capabilities; pods run as non-root; no image is `:latest`; kustomization resources exist.
- Alert rules (deploy/monitoring/alerts.yml): every alert over `increase(...)` says in its
  `resolves` annotation how long it lingers after the cause is gone (its window), and every
  alert has a summary, a description and a runbook link.

yamllint (style) runs beside it in deploy/lint.sh. Exit status 1 on any finding.
"""

import glob
import os
import re
import sys

import hcl2
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
TERRAFORM = os.path.join(HERE, "gcp", "terraform")
K8S = os.path.join(HERE, "gcp", "k8s")
ALERTS = os.path.join(HERE, "monitoring", "alerts.yml")

findings = []


def finding(where, what):
    findings.append(f"{where}: {what}")


def terraform():
    declared_vars, declared_locals, declared_resources = set(), set(), set()
    texts = {}
    for path in sorted(glob.glob(os.path.join(TERRAFORM, "*.tf"))):
        with open(path) as f:
            text = f.read()
        texts[path] = text
        try:
            parsed = hcl2.loads(text)
        except Exception as e:  # the parser's own exception types vary by version
            finding(path, f"does not parse as HCL2: {e}")
            continue
        for block in parsed.get("variable", []):
            declared_vars.update(k.strip('"') for k in block)
        for block in parsed.get("locals", []):
            declared_locals.update(k.strip('"') for k in block)
        for block in parsed.get("resource", []):
            for kind, named in block.items():
                for name in named:
                    declared_resources.add(f"{kind.strip(chr(34))}.{name.strip(chr(34))}")
    if not texts:
        finding(TERRAFORM, "no Terraform files")
        return
    codes = {
        path: "\n".join(line.split("#", 1)[0] for line in text.splitlines())
        for path, text in texts.items()
    }
    for path, code in codes.items():
        for name in re.findall(r"\bvar\.([A-Za-z_][A-Za-z0-9_]*)", code):
            if name not in declared_vars:
                finding(path, f"var.{name} is not declared")
        for name in re.findall(r"\blocal\.([A-Za-z_][A-Za-z0-9_]*)", code):
            if name not in declared_locals:
                finding(path, f"local.{name} is not declared")
        for kind, name in re.findall(r"\b(google_[a-z0-9_]+)\.([A-Za-z_][A-Za-z0-9_]*)\b", code):
            if f"{kind}.{name}" not in declared_resources:
                finding(path, f"{kind}.{name} is not a declared resource")
    everything = "\n".join(codes.values())
    if "@sha256:[0-9a-f]{64}$" not in everything:
        finding(TERRAFORM, "the enclave image variable must be validated as a digest reference")
    if 'public_access_prevention    = "enforced"' not in everything:
        finding(TERRAFORM, "the bucket must enforce public access prevention")
    if "contributions/" not in everything or 'type = "Delete"' not in everything:
        finding(TERRAFORM, "the bucket needs the lifecycle rule that deletes contributions")
    for role in ("roles/storage.objectAdmin", "roles/storage.admin", "roles/owner", "roles/editor"):
        if role in everything:
            finding(TERRAFORM, f"{role} grants more than create and read")
    if "confidential-space-debug" in everything:
        finding(TERRAFORM, "production enclave VMs must not boot the debug image")
    if re.search(r"tee-env-CONFED_WORKER_TOKEN\s*=", everything):
        finding(TERRAFORM, "the worker token must not travel in tee-env (it lands in every attestation token): use tee-env-CONFED_WORKER_TOKEN_SECRET")


def containers_of(doc):
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", spec if doc.get("kind") == "Pod" else {})
    return pod, pod.get("initContainers", []) + pod.get("containers", [])


def kubernetes():
    files = sorted(glob.glob(os.path.join(K8S, "*.yaml")))
    if not files:
        finding(K8S, "no manifests")
    for path in files:
        with open(path) as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        for doc in docs:
            where = f"{os.path.basename(path)} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            if os.path.basename(path) == "kustomization.yaml":
                for resource in doc.get("resources", []):
                    if not os.path.exists(os.path.join(K8S, resource)):
                        finding(where, f"resource {resource} does not exist")
                continue
            for field in ("apiVersion", "kind"):
                if field not in doc:
                    finding(where, f"no {field}")
            if not doc.get("metadata", {}).get("name"):
                finding(where, "no metadata.name")
            pod, containers = containers_of(doc)
            if not containers:
                continue
            if not pod.get("securityContext", {}).get("runAsNonRoot"):
                finding(where, "the pod must set securityContext.runAsNonRoot")
            for c in containers:
                name = f"{where} container {c.get('name')}"
                image = c.get("image", "")
                if image.endswith(":latest") or ":" not in image.rsplit("/", 1)[-1]:
                    finding(name, f"image {image!r} needs a pinned tag or digest")
                if not c.get("resources", {}).get("requests"):
                    finding(name, "no resource requests")
                sc = c.get("securityContext", {})
                if sc.get("allowPrivilegeEscalation") is not False:
                    finding(name, "allowPrivilegeEscalation must be false")
                if sc.get("readOnlyRootFilesystem") is not True:
                    finding(name, "readOnlyRootFilesystem must be true")
                if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                    finding(name, "must drop ALL capabilities")


def alerts():
    with open(ALERTS) as f:
        rules = yaml.safe_load(f)
    for group in rules["groups"]:
        for rule in group["rules"]:
            name = rule.get("alert")
            if name is None:
                continue
            annotations = rule.get("annotations", {})
            for needed in ("summary", "description", "runbook"):
                if not annotations.get(needed):
                    finding(f"alerts.yml {name}", f"has no {needed} annotation")
            if "increase(" in rule["expr"] and not annotations.get("resolves"):
                finding(
                    f"alerts.yml {name}",
                    "uses increase() but has no `resolves` annotation saying how long it lingers",
                )


terraform()
kubernetes()
alerts()
for line in findings:
    print(line)
if findings:
    sys.exit(1)
print("deploy/lint.py: Terraform, Kubernetes manifests and alert rules pass")
