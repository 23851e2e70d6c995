"""Thin boto3 adapter for an S3 (or S3-compatible) prefix: fail-fast probe, transfers, listing; and the transport
of s3:// models and data (`S3Source`), which it registers with the resolver (models/resolve.py) when imported: every
process of a job imports this module (through its checkpoint store, or components/launch/ranks.py).

A run's credentials: a store of a run (`S3Store(..., run=name)`, what every CheckpointStore on S3 is) in a pod whose
service account has an IRSA role (AWS_ROLE_ARN and AWS_WEB_IDENTITY_TOKEN_FILE set, infra/terraform/modules/iam)
makes its requests with that role assumed again with the session tag `run=<name>` (`tagged_session`), refreshed
before it expires: the role's policy lets a session write only under `<checkpoint_prefix>${aws:PrincipalTag/run}/`,
so what a run's processes write reaches no other run's store. Elsewhere (a workstation, an S3-compatible server,
static keys) the default credentials are used as they are."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import timezone
from email.utils import parsedate_to_datetime
from pathlib import Path
from urllib.parse import urlparse

import boto3
import botocore.session
from boto3.s3.transfer import TransferConfig
from boto3.exceptions import Boto3Error
from botocore.config import Config
from botocore.credentials import DeferredRefreshableCredentials
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from models.resolve import register_remote

_MISSING = ("404", "NoSuchKey", "NotFound")
_CONDITION_FAILED = ("412", "PreconditionFailed", "409", "ConditionalRequestConflict")
RUN_TAG = "run"  # the session tag of a run's credentials (infra/terraform/modules/iam: ${aws:PrincipalTag/run})


@dataclass(frozen=True)
class S3Location:
    """`s3://bucket/prefix` split into its parts."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, uri: str) -> S3Location:
        parsed = urlparse(uri)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"not an s3://bucket/prefix URI: {uri!r}")
        return cls(parsed.netloc, parsed.path.strip("/"))

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def resolve_endpoint(endpoint_url: str | None) -> str | None:
    """Explicit endpoint > AWS_ENDPOINT_URL_S3 > MLFLOW_S3_ENDPOINT_URL > None (AWS)."""
    return endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("MLFLOW_S3_ENDPOINT_URL") or None


def tagged_session(region: str, run: str, env: Mapping[str, str] = os.environ) -> boto3.session.Session:
    """The boto3 session of run `run`'s store: with IRSA (the pod's role in AWS_ROLE_ARN, its web identity token in
    AWS_WEB_IDENTITY_TOKEN_FILE) that role assumed again with the session tag run=<run> (its trust policy allows
    exactly that, and only to itself), renewed by botocore before the hour of a chained session ends; without IRSA,
    the default credentials."""
    role = env.get("AWS_ROLE_ARN")
    if not (role and env.get("AWS_WEB_IDENTITY_TOKEN_FILE")):
        return boto3.session.Session(region_name=region)
    sts = boto3.session.Session(region_name=region).client("sts")

    def assume() -> dict:
        try:
            issued = sts.assume_role(RoleArn=role, RoleSessionName=f"rlhf-{run}"[:64], DurationSeconds=3600,
                                     Tags=[{"Key": RUN_TAG, "Value": run}])["Credentials"]
        except (BotoCoreError, ClientError) as exc:
            raise PermissionError(f"run {run}: cannot get its S3 credentials, sts:AssumeRole of {role} with the "
                                  f"session tag {RUN_TAG}={run} failed ({exc}); the role's trust policy must let it "
                                  f"assume itself with that tag (infra/terraform/modules/iam)") from None
        return {"access_key": issued["AccessKeyId"], "secret_key": issued["SecretAccessKey"],
                "token": issued["SessionToken"], "expiry_time": issued["Expiration"].isoformat()}

    core = botocore.session.get_session()
    # botocore has no public setter for refreshable credentials: this is how its own assume-role providers hand them
    core._credentials = DeferredRefreshableCredentials(refresh_using=assume, method="assume-role-with-run-tag")
    return boto3.session.Session(botocore_session=core, region_name=region)


def _config(endpoint_url: str | None, *, attempts: int, connect_timeout: float, read_timeout: float) -> Config:
    return Config(
        retries={"mode": "standard", "max_attempts": attempts},
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": "path"} if endpoint_url else {},
    )


class S3Store:
    """Objects under one bucket/prefix; keys passed in and out are relative to the prefix. `run`: the run whose store
    this prefix is: its requests carry that run's credentials (`tagged_session`)."""

    def __init__(
        self,
        location: S3Location,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        multipart_threshold: int = 64 * 1024 * 1024,
        multipart_chunksize: int = 16 * 1024 * 1024,
        error: type[Exception] = RuntimeError,
        run: str | None = None,
    ) -> None:
        self.location = location
        self.endpoint_url = resolve_endpoint(endpoint_url)
        self.region = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
        self._error = error
        self._session = (tagged_session(self.region, run) if run else boto3.session.Session(region_name=self.region))
        self.client = self._client(attempts=5, connect_timeout=10, read_timeout=120)
        self.transfer = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize, max_concurrency=4
        )

    def _client(self, *, attempts: int, connect_timeout: float, read_timeout: float):
        config = _config(self.endpoint_url, attempts=attempts, connect_timeout=connect_timeout,
                         read_timeout=read_timeout)
        return self._session.client("s3", endpoint_url=self.endpoint_url, config=config)

    @property
    def endpoint(self) -> str:
        return self.client.meta.endpoint_url

    def _key(self, key: str) -> str:
        return f"{self.location.prefix}/{key}" if self.location.prefix else key

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except NoCredentialsError as exc:
            raise self._error(f"no AWS credentials to {what} at S3 endpoint {self.endpoint}: {exc}") from exc
        except ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            raise self._error(f"cannot {what} at S3 endpoint {self.endpoint}: HTTP {status}: {exc}") from exc
        except (BotoCoreError, Boto3Error) as exc:
            raise self._error(f"cannot {what} at S3 endpoint {self.endpoint}: {exc}") from exc

    def probe(self) -> None:
        """HEAD the bucket with one short attempt: unreachable endpoint or missing bucket fails in seconds."""
        bucket = self.location.bucket
        client = self._client(attempts=1, connect_timeout=3, read_timeout=10)
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket", "NotFound"):
                raise self._error(f"bucket '{bucket}' does not exist at {self.endpoint}") from exc
            if code in ("403", "AccessDenied"):
                raise self._error(f"access to bucket '{bucket}' at {self.endpoint} is denied") from exc
            raise self._error(f"cannot access bucket '{bucket}' at {self.endpoint}: {exc}") from exc
        except NoCredentialsError as exc:
            raise self._error(f"no AWS credentials for S3 endpoint {self.endpoint}: {exc}") from exc
        except BotoCoreError as exc:
            raise self._error(f"cannot reach S3 endpoint {self.endpoint}: {exc}") from exc

    def upload_file(self, local: Path, key: str) -> None:
        """Upload through the transfer manager (multipart above the threshold)."""
        with self._errors(f"upload {local} to s3://{self.location.bucket}/{self._key(key)}"):
            self.client.upload_file(str(local), self.location.bucket, self._key(key), Config=self.transfer)

    def download_file(self, key: str, local: Path) -> bool:
        """Download `key` to `local`; False if it does not exist."""
        local.parent.mkdir(parents=True, exist_ok=True)
        with self._errors(f"download s3://{self.location.bucket}/{self._key(key)}"):
            try:
                self.client.download_file(self.location.bucket, self._key(key), str(local), Config=self.transfer)
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING:
                    return False
                raise
        return True

    def copy_key(self, source: str, target: str) -> None:
        """Server-side copy within the bucket (managed: multipart copy for large objects)."""
        bucket = self.location.bucket
        with self._errors(f"copy s3://{bucket}/{self._key(source)} to s3://{bucket}/{self._key(target)}"):
            self.client.copy({"Bucket": bucket, "Key": self._key(source)}, bucket, self._key(target),
                             Config=self.transfer)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self._errors(f"write s3://{self.location.bucket}/{self._key(key)}"):
            self.client.put_object(Bucket=self.location.bucket, Key=self._key(key), Body=data)

    def put_if(self, key: str, data: bytes, *, absent: bool = False, etag: str | None = None) -> str | None:
        """A conditional write (S3's If-None-Match: * with `absent`, If-Match: `etag` otherwise): the new object's
        ETag, or None when the condition failed (the object exists / has another ETag: someone else wrote it)."""
        condition = {"IfNoneMatch": "*"} if absent else {"IfMatch": etag}
        with self._errors(f"write s3://{self.location.bucket}/{self._key(key)}"):
            try:
                return self.client.put_object(Bucket=self.location.bucket, Key=self._key(key), Body=data,
                                              **condition)["ETag"]
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _CONDITION_FAILED:
                    return None
                raise

    def stat(self, key: str) -> tuple[bytes, str, float] | None:
        """(body, ETag, age in seconds by the server's own clock) of `key`, None if it does not exist."""
        found = self._get_object(key)
        if found is None:
            return None
        body, response = found
        now = parsedate_to_datetime(response["ResponseMetadata"]["HTTPHeaders"]["date"])
        if now.tzinfo is None:  # a proxy's Date without a zone: HTTP dates are GMT
            now = now.replace(tzinfo=timezone.utc)
        return body, response["ETag"], (now - response["LastModified"]).total_seconds()

    def versioned(self, key: str) -> tuple[bytes, str] | None:
        """(body, ETag) of `key` (what a conditional write on it names), None if it does not exist."""
        found = self._get_object(key)
        return None if found is None else (found[0], found[1]["ETag"])

    def _get_object(self, key: str) -> tuple[bytes, dict] | None:
        """(body, boto3's get_object answer) of `key`, None if it does not exist; failures named as reads of it."""
        with self._errors(f"read s3://{self.location.bucket}/{self._key(key)}"):
            try:
                response = self.client.get_object(Bucket=self.location.bucket, Key=self._key(key))
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _MISSING:
                    return None
                raise
            return response["Body"].read(), response

    def delete_if(self, key: str, etag: str) -> bool:
        """Delete `key` if it still has `etag` (If-Match); False when someone else's object is there now."""
        with self._errors(f"delete s3://{self.location.bucket}/{self._key(key)}"):
            try:
                self.client.delete_object(Bucket=self.location.bucket, Key=self._key(key), IfMatch=etag)
                return True
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in _CONDITION_FAILED + _MISSING:
                    return False
                raise

    def get_bytes(self, key: str) -> bytes | None:
        """Object body, or None if it does not exist."""
        found = self._get_object(key)
        return None if found is None else found[0]

    def list_keys(self, prefix: str = "") -> list[str]:
        """Keys (relative to the store prefix) that start with `prefix`, sorted."""
        base = self._key("") if self.location.prefix else ""
        keys = []
        with self._errors(f"list s3://{self.location.bucket}/{base}{prefix}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.location.bucket, Prefix=base + prefix
            )
            for page in pages:
                keys.extend(obj["Key"][len(base) :] for obj in page.get("Contents", []))
        return sorted(keys)

    def delete_keys(self, keys: list[str]) -> None:
        for start in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[start : start + 1000]]
            with self._errors(f"delete objects in s3://{self.location.bucket}/{self.location.prefix}"):
                response = self.client.delete_objects(Bucket=self.location.bucket, Delete={"Objects": batch})
            if response.get("Errors"):
                raise self._error(f"cannot delete objects at {self.endpoint}: {response['Errors'][:3]}")


class S3Source:
    """s3:// models and data for the resolver (models/resolve.Remote): list a prefix (or one object) with sizes and
    ETags, read the digests a CheckpointStore wrote beside a prefix (`<prefix>.sha256.json`), download an object."""

    def __init__(self, endpoint_url: str | None = None) -> None:
        self.endpoint_url = endpoint_url
        self._stores: dict[str, S3Store] = {}

    def _store(self, uri: str) -> S3Store:
        """The S3Store of a bucket/prefix, one client per prefix of this source."""
        if uri not in self._stores:
            self._stores[uri] = S3Store(S3Location.parse(uri), endpoint_url=self.endpoint_url)
        return self._stores[uri]

    def objects(self, uri: str, prefix_only: bool) -> tuple[bool, dict[str, tuple[int, str]]]:
        location = S3Location.parse(uri)
        store = self._store(f"s3://{location.bucket}")
        if not prefix_only and location.prefix:
            with store._errors(f"read {uri}"):
                try:
                    head = store.client.head_object(Bucket=location.bucket, Key=location.prefix)
                    return False, {location.prefix.rsplit("/", 1)[-1]: (int(head["ContentLength"]), head["ETag"])}
                except ClientError as exc:
                    if str(exc.response.get("Error", {}).get("Code", "")) not in _MISSING:
                        raise
        prefix = f"{location.prefix}/" if location.prefix else ""
        found = {}
        with store._errors(f"list {uri}/"):
            for page in store.client.get_paginator("list_objects_v2").paginate(Bucket=location.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    if not obj["Key"].endswith("/"):  # a "folder" placeholder some tools write
                        found[obj["Key"][len(prefix):]] = (int(obj["Size"]), obj["ETag"])
        return True, found

    def digests(self, uri: str) -> dict[str, str] | None:
        location = S3Location.parse(uri)
        raw = self._store(f"s3://{location.bucket}").get_bytes(f"{location.prefix}.sha256.json")
        return json.loads(raw) if raw is not None else None

    def download(self, uri: str, name: str, local: Path) -> None:
        if not self._store(uri).download_file(name, local):
            raise FileNotFoundError(f"{uri}/{name} does not exist")


register_remote("s3", S3Source)
