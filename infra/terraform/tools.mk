# Tooling for the Terraform static checks (tests/infra). Included from the root Makefile:
#   include infra/terraform/tools.mk
# checkov pins boto3==1.35.49, so it lives in its own virtualenv, never the project's .venv.

CHECKOV_PYTHON  ?= python3
CHECKOV_VERSION ?= 3.3.30
CHECKOV_VENV    ?= .venv-checkov
CHECKOV_STAMP   := $(CHECKOV_VENV)/.checkov-$(CHECKOV_VERSION).stamp
CHECKOV_BIN     := $(CHECKOV_VENV)/bin/checkov
TF_DIR          ?= infra/terraform

.PHONY: tools tf-checks

tools: $(CHECKOV_STAMP)

# Re-created only when the pinned version changes (the stamp file names the version).
# Installed by uv like the project's environments (the root Makefile's $$(UV_INSTALL)).
$(CHECKOV_STAMP): | $(UV)
	test -x $(CHECKOV_VENV)/bin/python || $(CHECKOV_PYTHON) -m venv $(CHECKOV_VENV)
	$(UV_INSTALL) $(CHECKOV_VENV)/bin/python "checkov==$(CHECKOV_VERSION)"
	rm -f $(CHECKOV_VENV)/.checkov-*.stamp
	touch $@

# Runs checkov offline on the Terraform tree (the pytest suite does the same plus fmt/HCL checks).
tf-checks: tools
	BC_SKIP_MAPPING=TRUE $(CHECKOV_BIN) -d $(TF_DIR) --quiet --compact --framework terraform --skip-download
