package agenttest

import (
	"net"
	"testing"

	"pilab.hu/pivirt-agent/identity"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

// EtcdPKI makes a PKI of its own for an etcd in dir, as a deployment has
// one beside PiTrust's: a CA, the members' server certificate for
// 127.0.0.1 and localhost, and a client certificate that agents (as
// service_discovery.etcd's ca_file, cert_file and key_file), etcdctl and
// the members' own gateway present.
func EtcdPKI(tb testing.TB, dir string) etcdtest.TLS {
	tb.Helper()
	ca, err := identity.InitCA(dir, identity.CAOptions{})
	if err != nil {
		tb.Fatalf("etcd CA: %v", err)
	}
	srv, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "etcd",
		DNS: []string{"localhost"}, IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		tb.Fatalf("etcd server certificate: %v", err)
	}
	cli, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-etcd"})
	if err != nil {
		tb.Fatalf("etcd client certificate: %v", err)
	}
	return etcdtest.TLS{
		CAFile:   ca.RootCert,
		CertFile: srv.Cert, KeyFile: srv.Key,
		ClientCertFile: cli.Cert, ClientKeyFile: cli.Key,
	}
}
