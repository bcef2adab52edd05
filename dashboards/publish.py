"""Publish the built dashboards to a Grafana (``sightline dashboards publish --url URL``).

Idempotent: the folder is looked up by uid and created only when missing; each
dashboard is posted with ``overwrite: true`` under its fixed uid, so publishing twice
leaves one copy of each, at the newest version. The token comes from ``GRAFANA_TOKEN``
(or ``user:password@`` in the URL). ``--dry-run`` prints the plan without contacting
Grafana. Cost: one GET for the folder, at most one POST to create it, one POST per
dashboard.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Literal

from .build import render_all

__all__ = ["FOLDER_UID", "FOLDER_TITLE", "PublishAction", "plan", "publish"]

FOLDER_UID = "sightline"
FOLDER_TITLE = "Sightline"
TOKEN_ENV = "GRAFANA_TOKEN"


@dataclasses.dataclass(frozen=True)
class PublishAction:
    """One step of a publish: ``ensure_folder`` (create unless present) or ``upsert_dashboard``."""

    kind: Literal["ensure_folder", "upsert_dashboard"]
    uid: str
    title: str
    payload: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> str:
        return f"{self.kind} uid={self.uid} title={self.title!r}"


def plan(folder_uid: str = FOLDER_UID, folder_title: str = FOLDER_TITLE) -> list[PublishAction]:
    """The actions a publish performs, computed offline from a fresh build."""
    if not folder_uid or len(folder_uid) > 40:
        raise ValueError(f"folder uid {folder_uid!r} must be 1..40 characters")
    actions = [PublishAction("ensure_folder", folder_uid, folder_title)]
    for text in render_all().values():
        dashboard = json.loads(text)
        payload = {
            "dashboard": dashboard,
            "folderUid": folder_uid,
            "overwrite": True,
            "message": "sightline dashboards publish",
        }
        actions.append(PublishAction("upsert_dashboard", dashboard["uid"], dashboard["title"], payload))
    return actions


def publish(
    url: str,
    *,
    token: str | None = None,
    folder_uid: str = FOLDER_UID,
    folder_title: str = FOLDER_TITLE,
    dry_run: bool = False,
    timeout_s: float = 10.0,
) -> list[PublishAction]:
    """Performs :func:`plan` against the Grafana at ``url``; returns the actions taken.

    Raises ``grafana_client.client.GrafanaException`` subclasses on HTTP errors other
    than the folder's 404 (which means: create it).
    """
    actions = plan(folder_uid, folder_title)
    if dry_run:
        return actions
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError

    credential = token if token is not None else os.environ.get(TOKEN_ENV) or None
    api = GrafanaApi.from_url(url, credential=credential, timeout=timeout_s)
    for action in actions:
        if action.kind == "ensure_folder":
            try:
                api.folder.get_folder(action.uid)
            except GrafanaClientError as exc:
                if exc.status_code != 404:
                    raise
                api.folder.create_folder(action.title, uid=action.uid)
        else:
            api.dashboard.update_dashboard(action.payload)
    return actions
