"""The local cluster's DNS: A records of Services and their pods under cluster.local, read from
the API server, as CoreDNS's kubernetes plugin answers them:

- `<service>.<namespace>.svc.cluster.local`: the ClusterIP, or for a headless Service the
  addresses of its ready endpoints;
- `<hostname>.<service>.<namespace>.svc.cluster.local`: the endpoint with that hostname (a
  StatefulSet's pods under their governing Service).

Every other name is NXDOMAIN: nothing is forwarded off the machine.

    python -m tests.cluster.localkube.dns --kubeconfig FILE --listen 10.244.0.1
"""

from __future__ import annotations

import argparse
import time

from dnslib import QTYPE, RCODE, RR, A, DNSRecord
from dnslib.server import BaseResolver, DNSHandler, DNSLogger, DNSServer
from kubernetes import client, config

ZONE = "svc.cluster.local."
TTL_S = 5


class ClusterResolver(BaseResolver):  # type: ignore[misc]
    def __init__(self, core: client.CoreV1Api) -> None:
        self.core = core

    def resolve(self, request: DNSRecord, handler: DNSHandler) -> DNSRecord:
        reply = request.reply()
        name = str(request.q.qname).lower()
        addresses = self.addresses(name) if name.endswith("." + ZONE) else None
        if addresses is None:
            reply.header.rcode = RCODE.NXDOMAIN
        elif request.q.qtype in (QTYPE.A, QTYPE.ANY):
            for address in addresses:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=TTL_S))
        return reply  # a name that exists but has no record of that type: empty NOERROR

    def addresses(self, name: str) -> list[str] | None:
        """The A records of `name`, None when it does not exist."""
        labels = name[: -len(ZONE) - 1].split(".")
        if len(labels) == 2:
            service, namespace = labels
            host = None
        elif len(labels) == 3:
            host, service, namespace = labels
        else:
            return None
        try:
            svc = self.core.read_namespaced_service(service, namespace)
            endpoints = self.core.read_namespaced_endpoints(service, namespace)
        except client.ApiException:
            return None
        if host is None and svc.spec.cluster_ip not in (None, "None"):
            return [svc.spec.cluster_ip]
        ready = [a for subset in endpoints.subsets or [] for a in subset.addresses or []]
        if host is None:
            return sorted({a.ip for a in ready})
        matches = [a.ip for a in ready if a.hostname == host]
        return matches or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--listen", required=True)
    parser.add_argument("--port", type=int, default=53)
    args = parser.parse_args()
    core = client.CoreV1Api(config.new_client_from_config(args.kubeconfig))
    resolver = ClusterResolver(core)
    servers = [
        DNSServer(resolver, address=args.listen, port=args.port, tcp=tcp, logger=DNSLogger("error"))
        for tcp in (False, True)
    ]
    for server in servers:
        server.start_thread()
    while all(s.isAlive() for s in servers):
        time.sleep(1)


if __name__ == "__main__":
    main()
