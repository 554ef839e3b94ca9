package main

import (
	"bytes"
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/identity"
)

// TestRecoverCommandRefuses checks the recover subcommand's input errors:
// each names what is wrong and touches nothing.
func TestRecoverCommandRefuses(t *testing.T) {
	dir := t.TempDir()
	peers := filepath.Join(dir, "peers.json")
	if err := os.WriteFile(peers, []byte(`[{"id":"n1","address":"127.0.0.1:8300"}]`), 0o600); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.Mkdir(empty, 0o700); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"recover"}, "--data-dir and --peers are required"},
		{[]string{"recover", "--data-dir", empty}, "--data-dir and --peers are required"},
		{[]string{"recover", "--data-dir", empty, "--peers", filepath.Join(dir, "missing.json")}, "peers file"},
		{[]string{"recover", "--data-dir", empty, "--peers", peers}, "no node-id here"},
		{[]string{"recover", "--data-dir", empty, "--peers", peers, "extra"}, "unknown command"},
	} {
		var out, errOut bytes.Buffer
		err := Run(context.Background(), tt.args, &out, &errOut)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("pivirt-agent %s = %v, want an error containing %q", strings.Join(tt.args, " "), err, tt.want)
		}
	}
	if entries, _ := os.ReadDir(empty); len(entries) != 0 {
		t.Errorf("a refused recover wrote into the data dir: %v", entries)
	}
}

// TestValidateCommand: pivirt-agent validate --config FILE checks the
// file's keys and values and the files it names, offline.
func TestValidateCommand(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	badPolicy := write("rbac.yaml", "apiVersion: rbac.pivirt.pilab.hu/v1\nkind: Policy\nrules:\n  - roles: [x]\n    resources: [vms]\n    verbs: [get]\n")
	shortKey := write("short.key", "YWJj\n") // "abc": 3 bytes
	notBase64 := write("garbled.key", "not base64!\n")
	readableKey := write("readable.key", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n") // 32 bytes
	if err := os.Chmod(readableKey, 0o644); err != nil {
		t.Fatal(err)
	}
	pki := filepath.Join(dir, "pki")
	if _, err := identity.InitCA(pki, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	srv, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindServer, Name: "node-01", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	cli, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node-02"})
	if err != nil {
		t.Fatal(err)
	}
	withCerts := func(nodeName string, tlsLines ...string) string {
		return "data_dir: " + dir + "\nnode_name: " + nodeName + "\ntls:\n  enabled: true\n  ca_file: " + filepath.Join(pki, identity.ChainFile) +
			"\n  cert_file: " + cli.Cert + "\n  key_file: " + cli.Key + "\n" + strings.Join(tlsLines, "") + "server:\n  connectrpc:\n    tls:\n      cert_file: " + srv.Cert + "\n      key_file: " + srv.Key + "\n      ca_file: " + filepath.Join(pki, identity.ChainFile) + "\n      client_ca_file: " + filepath.Join(pki, identity.ChainFile) + "\n"
	}
	otherPKI := filepath.Join(dir, "other-pki")
	if _, err := identity.InitCA(otherPKI, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	for name, tc := range map[string]struct {
		body string
		want string
	}{
		"good with certificates": {withCerts("node-02"), "ok"},
		"good cluster ca": {withCerts("node-02", "  cluster_ca:\n    enabled: true\n    cert_file: "+filepath.Join(pki, identity.IntermediateCertFile)+
			"\n    key_file: "+filepath.Join(pki, identity.IntermediateKeyFile)+"\n"), "ok"},
		"cluster ca of another chain": {withCerts("node-02", "  cluster_ca:\n    enabled: true\n    cert_file: "+filepath.Join(otherPKI, identity.IntermediateCertFile)+
			"\n    key_file: "+filepath.Join(otherPKI, identity.IntermediateKeyFile)+"\n"), "does not chain to tls.ca_file"},
		"backend tls files": {withCerts("node-02") + "backends:\n  pivirtd:\n    endpoint: unix:///run/pivirtd/pivirtd.sock\n    tls:\n      enabled: true\n      ca_file: " + dir + "/none.pem\n",
			"backends.pivirtd.tls"},
		"etcd tls files": {withCerts("node-02") + "service_discovery:\n  type: etcd\n  etcd:\n    endpoints: [\"https://127.0.0.1:2379\"]\n    ca_file: " + dir + "/none.pem\n",
			"service_discovery.etcd"},
		"another node's agent certificate": {withCerts("node-01"), `is the agent identity of node "node-02", but node_name is "node-01"`},
		"good":                             {"data_dir: " + dir + "\ntls:\n  enabled: false\n", "ok"},
		"bad value":                        {"data_dir: " + dir + "\ntls:\n  enabled: false\nrate_limiting:\n  enabled: true\n  requests_per_second: 0\n", "rate_limiting.requests_per_second"},
		"unknown key":                      {"data_dir: " + dir + "\ntls:\n  enabled: false\nratelimiting: {}\n", "ratelimiting: unknown key"},
		"bad policy":                       {"data_dir: " + dir + "\ntls:\n  enabled: false\nauth:\n  rbac_policy: " + badPolicy + "\n", `rules[0].resources[0]: unknown "vms"`},
		"missing certificates":             {"data_dir: " + dir + "\ntls:\n  enabled: true\n  cert_file: " + dir + "/none.crt\n  key_file: " + dir + "/none.key\n  ca_file: " + dir + "/ca.pem\n", "none.crt"},
		// What the agent refuses at start, validate refuses too.
		"3-byte gossip key":             {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + shortKey + "\n", "key is 3 bytes"},
		"gossip key not base64":         {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + notBase64 + "\n", "is not base64"},
		"missing gossip key":            {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + dir + "/none.key\n", "cluster.gossip.encrypt_key_file"},
		"gossip key readable by others": {"data_dir: " + dir + "\ntls:\n  enabled: false\ncluster:\n  gossip:\n    encrypt_key_file: " + readableKey + "\n", "readable by group or others"},
		"verify_peer false":             {"data_dir: " + dir + "\ntls:\n  enabled: true\n  verify_peer: false\n", "tls.verify_peer"},
	} {
		path := write(strings.ReplaceAll(name, " ", "-")+".yaml", tc.body)
		var out, errOut bytes.Buffer
		err := Run(t.Context(), []string{"validate", "--config", path}, &out, &errOut)
		if tc.want == "ok" {
			if err != nil || !strings.Contains(out.String(), path+": ok") {
				t.Errorf("%s: %v %q", name, err, out.String())
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: %v, want an error naming the file and %q", name, err, tc.want)
		}
	}
}

// TestValidateShowsRoutes: validate prints the backends with their scope,
// the routes in force (the defaults without a routing block, as the spec's
// example configuration has none) and the APIs no backend serves.
func TestValidateShowsRoutes(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "agent.yaml")
	body := "data_dir: " + dir + "\ntls:\n  enabled: false\nbackends:\n  pivirtd:\n    endpoint: unix:///run/pivirtd/pivirtd.sock\n    timeout: 30s\n" +
		"  osinfodb:\n    endpoint: https://osinfodb.pilab.hu:8443\n"
	if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	var out, errOut bytes.Buffer
	if err := Run(t.Context(), []string{"validate", "--config", path}, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		path + ": ok",
		"backend pivirtd: unix:///run/pivirtd/pivirtd.sock, scope node",
		"backend osinfodb: https://osinfodb.pilab.hu:8443, scope cluster",
		"default route: /pivirt.vm.v1.VMService/ -> pivirtd",
		"default route: /pivirt.network.v1.NetworkService/ -> pivirtd",
		"not served: pivirt.storage.v1.StorageService (backends.iscsiman is not configured)",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("validate printed\n%s\nwant a line %q", out.String(), want)
		}
	}
}
