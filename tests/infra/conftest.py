"""Fixtures of the infra tests: what Prefect's Kubernetes worker would create for every deployment of prefect.yaml
(tests/infra/test_work_pools.py says how it is rendered)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.infra.test_terraform import (POOLS, SAMPLE_ENV, _flow_name, _prefect_yaml, _render_template, _rendered,
                                        _sample_values)


@pytest.fixture(scope="session")
def rendered():
    """{deployment name: (its flow run, the Job the worker would create)} for every deployment of prefect.yaml."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    async def render(deployment: dict):
        pool = deployment["work_pool"]
        template = _render_template(_sample_values(pool["name"], POOLS[pool["name"]]))
        variables = _rendered(pool.get("job_variables") or {}, SAMPLE_ENV)
        configuration = await KubernetesWorkerJobConfiguration.from_template_and_values(template, variables)
        flow_run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="brave-heron")
        configuration.prepare_for_flow_run(flow_run)
        return flow_run, configuration.job_manifest

    out = {}
    with temporary_settings({PREFECT_API_URL: "http://prefect.invalid/api"}):  # no temporary server: nothing is asked
        for deployment in _prefect_yaml()["deployments"]:
            name = f"{_flow_name(deployment['entrypoint'])}/{deployment['name']}"
            out[name] = asyncio.run(render(deployment))
    return out
