"""``sightline dashboards build`` and ``sightline dashboards publish``.

Module-level imports are stdlib only (``sightline --help`` stays instant); the SDK and
grafana-client load inside the handlers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

__all__ = ["register"]


def _build(args: argparse.Namespace) -> int:
    from .build import write_all
    from .provisioning import write_provisioning

    for path in write_all(Path(args.out)):
        print(path)
    if args.provisioning_out:
        for path in write_provisioning(Path(args.provisioning_out)):
            print(path)
    return 0


def _publish(args: argparse.Namespace) -> int:
    from .publish import publish

    actions = publish(args.url, folder_uid=args.folder_uid, folder_title=args.folder_title, dry_run=args.dry_run)
    prefix = "would " if args.dry_run else ""
    for action in actions:
        print(f"{prefix}{action.describe()}")
    if not args.dry_run:
        print(f"published {len(actions) - 1} dashboards to {args.url}", file=sys.stderr)
    return 0


def register(subcommands: argparse._SubParsersAction) -> None:
    dashboards = subcommands.add_parser("dashboards", help="Grafana dashboards as code")
    dashboards_sub = dashboards.add_subparsers(dest="dashboards_command", required=True, metavar="COMMAND")

    build = dashboards_sub.add_parser("build", help="write the dashboards' JSON (commit it)")
    default_out = Path(__file__).resolve().parent / "json"
    build.add_argument("--out", default=str(default_out), help=f"output folder (default: {default_out})")
    default_provisioning = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "provisioning"
    build.add_argument("--provisioning-out", default=str(default_provisioning),
                       help="Grafana provisioning folder (datasources, dashboard provider); '' to skip "
                       f"(default: {default_provisioning})")
    build.set_defaults(handler=_build)

    publish = dashboards_sub.add_parser(
        "publish", help="create the folder and upsert every dashboard by uid (token from GRAFANA_TOKEN)"
    )
    publish.add_argument("--url", required=True, help="Grafana base URL, e.g. http://localhost:3000")
    publish.add_argument("--folder-uid", default="sightline", help="folder uid (default: sightline)")
    publish.add_argument("--folder-title", default="Sightline", help="folder title (default: Sightline)")
    publish.add_argument("--dry-run", action="store_true", help="print the plan; do not contact Grafana")
    publish.set_defaults(handler=_publish)
