package identity

import (
	"crypto/x509"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Mode().Perm()
}

func TestInitCA(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	files, err := InitCA(dir, CAOptions{})
	if err != nil {
		t.Fatalf("InitCA: %v", err)
	}
	for _, k := range []string{files.RootKey, files.IntermediateKey} {
		if m := mode(t, k); m != 0o600 {
			t.Errorf("%s mode %v, want 0600", k, m)
		}
	}
	if m := mode(t, dir); m != 0o700 {
		t.Errorf("dir mode %v, want 0700", m)
	}
	root, err := ReadCertificates(files.RootCert)
	if err != nil {
		t.Fatal(err)
	}
	chain, err := ReadCertificates(files.Chain)
	if err != nil {
		t.Fatal(err)
	}
	if len(chain) != 2 || chain[0].Subject.CommonName != IntermediateCommonName || chain[1].Subject.CommonName != RootCommonName {
		t.Fatalf("ca-chain.pem holds %d certificates, want the intermediate then the root", len(chain))
	}
	if err := chain[0].CheckSignatureFrom(root[0]); err != nil {
		t.Errorf("the intermediate is not signed by the root: %v", err)
	}
	if !chain[0].IsCA || !chain[0].MaxPathLenZero || !root[0].IsCA || root[0].MaxPathLen != 1 {
		t.Errorf("CA constraints: root IsCA %v MaxPathLen %d, intermediate IsCA %v MaxPathLenZero %v",
			root[0].IsCA, root[0].MaxPathLen, chain[0].IsCA, chain[0].MaxPathLenZero)
	}
	if ca, _, err := LoadCA(dir); err != nil || ca.Subject.CommonName != IntermediateCommonName {
		t.Errorf("LoadCA: %v", err)
	}

	// No overwrite without Force, and nothing written.
	before, _ := os.ReadFile(files.RootKey)
	if _, err := InitCA(dir, CAOptions{}); !errors.Is(err, ErrExists) || !strings.Contains(err.Error(), RootCertFile) {
		t.Errorf("InitCA over an existing CA = %v, want ErrExists naming %s", err, RootCertFile)
	}
	if after, _ := os.ReadFile(files.RootKey); string(after) != string(before) {
		t.Error("a refused InitCA changed the root key")
	}
	if _, err := InitCA(dir, CAOptions{Force: true}); err != nil {
		t.Errorf("InitCA with Force: %v", err)
	}
	if after, _ := os.ReadFile(files.RootKey); string(after) == string(before) {
		t.Error("InitCA with Force kept the old root key")
	}
	for _, opts := range []CAOptions{{RootDays: -1}, {RootDays: 10, IntermediateDays: 20}, {IntermediateDays: MaxDays + 1}} {
		if _, err := InitCA(t.TempDir(), opts); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("InitCA(%+v) = %v, want ErrInvalidRequest", opts, err)
		}
	}
}

func TestIssueAndVerify(t *testing.T) {
	dir := t.TempDir()
	files, err := InitCA(dir, CAOptions{})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	srv, err := Issue(dir, LeafRequest{Kind: KindServer, Name: "node-01.pivirt.internal", DNS: []string{"node-01.pivirt.internal", "localhost"}, IPs: []net.IP{net.ParseIP("127.0.0.1")}, Days: 30})
	if err != nil {
		t.Fatalf("Issue server: %v", err)
	}
	if m := mode(t, srv.Key); m != 0o600 {
		t.Errorf("server key mode %v, want 0600", m)
	}
	certs, err := ReadCertificates(srv.Cert)
	if err != nil {
		t.Fatal(err)
	}
	if len(certs) != 2 || certs[1].Subject.CommonName != IntermediateCommonName {
		t.Fatalf("%s holds %d certificates, want the leaf then the intermediate", srv.Cert, len(certs))
	}
	leaf := certs[0]
	if !slices.Equal(leaf.DNSNames, []string{"node-01.pivirt.internal", "localhost"}) || len(leaf.IPAddresses) != 1 || !slices.Equal(leaf.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}) {
		t.Errorf("server leaf: DNS %v IPs %v EKU %v", leaf.DNSNames, leaf.IPAddresses, leaf.ExtKeyUsage)
	}
	if d := leaf.NotAfter.Sub(now); d < 29*24*time.Hour || d > 31*24*time.Hour {
		t.Errorf("server leaf lives %s, want 30 days", d)
	}
	if key, err := ReadPrivateKey(srv.Key); err != nil || !publicKeysEqual(leaf.PublicKey, key.Public()) {
		t.Errorf("the server key does not belong to the certificate: %v", err)
	}
	res, err := Verify(srv.Cert, files.Chain, "localhost", now)
	if err != nil {
		t.Fatalf("Verify server: %v", err)
	}
	if len(res.Chain) != 3 || res.Usage != "server authentication" {
		t.Errorf("Verify = %+v, want a 3-certificate chain for server authentication", res)
	}
	if _, err := Verify(srv.Cert, files.RootCert, "", now); err != nil {
		t.Errorf("Verify against the root alone (the intermediate comes with the leaf): %v", err)
	}
	if _, err := Verify(srv.Cert, files.Chain, "node-02.pivirt.internal", now); err == nil || !strings.Contains(err.Error(), `not valid for "node-02.pivirt.internal"`) {
		t.Errorf("Verify with a wrong name = %v", err)
	}
	if _, err := Verify(srv.Cert, files.Chain, "", now.Add(40*24*time.Hour)); err == nil || !strings.Contains(err.Error(), "expired on") {
		t.Errorf("Verify after expiry = %v, want an error saying it expired", err)
	}

	cli, err := Issue(dir, LeafRequest{Kind: KindClient, Name: "pivirt-agent-node-01"})
	if err != nil {
		t.Fatalf("Issue client: %v", err)
	}
	if res, err := Verify(cli.Cert, files.Chain, "", now); err != nil || res.Usage != "client authentication" || res.Chain[0].Subject != "CN=pivirt-agent-node-01,OU=mtls-client,O=PiTrust" {
		t.Errorf("Verify client = %+v, %v", res, err)
	}

	// A certificate of another PiTrust CA is not trusted.
	other := t.TempDir()
	if _, err := InitCA(other, CAOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Verify(srv.Cert, filepath.Join(other, ChainFile), "", now); err == nil || !strings.Contains(err.Error(), "not signed by the given CA chain") {
		t.Errorf("Verify against another CA = %v", err)
	}

	// No overwrite without Force.
	if _, err := Issue(dir, LeafRequest{Kind: KindClient, Name: "pivirt-agent-node-01"}); !errors.Is(err, ErrExists) {
		t.Errorf("Issue over an existing key = %v, want ErrExists", err)
	}
	if _, err := Issue(dir, LeafRequest{Kind: KindClient, Name: "pivirt-agent-node-01", Force: true}); err != nil {
		t.Errorf("Issue with Force: %v", err)
	}

	// openssl agrees, as the spec's troubleshooting command runs it.
	openssl, err := exec.LookPath("openssl")
	if err != nil {
		t.Skip("openssl not installed: the openssl check is skipped")
	}
	for _, c := range []string{srv.Cert, cli.Cert} {
		out, err := exec.Command(openssl, "verify", "-CAfile", files.Chain, c).CombinedOutput()
		if err != nil || !strings.Contains(string(out), ": OK") {
			t.Errorf("openssl verify -CAfile %s %s: %v\n%s", files.Chain, c, err, out)
		}
	}
}

func TestIssueRefuses(t *testing.T) {
	dir := t.TempDir()
	if _, err := Issue(dir, LeafRequest{Kind: KindServer, Name: "a.example"}); !errors.Is(err, ErrNoCA) {
		t.Errorf("Issue without a CA = %v, want ErrNoCA", err)
	}
	if _, err := InitCA(dir, CAOptions{IntermediateDays: 10, RootDays: 20}); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		req  LeafRequest
		want string
	}{
		{LeafRequest{Kind: KindServer, Name: ""}, "name"},
		{LeafRequest{Kind: KindServer, Name: "../etc/passwd"}, "name"},
		{LeafRequest{Kind: KindServer, Name: "node_1"}, "needs --dns or --ip"},
		{LeafRequest{Kind: KindServer, Name: "a.example", DNS: []string{"bad name"}}, `dns "bad name"`},
		{LeafRequest{Kind: KindClient, Name: "c", IPs: []net.IP{net.IPv4(10, 0, 0, 1)}}, "--ip is for server"},
		{LeafRequest{Kind: KindClient, Name: "c", DNS: []string{"a b"}}, `dns "a b" is not a DNS name`},
		{LeafRequest{Kind: KindServer, Name: "a.example", Days: -5}, "days -5"},
		{LeafRequest{Kind: KindServer, Name: "a.example", Days: 30}, "outlive the intermediate"},
		{LeafRequest{Kind: "mtls-peer", Name: "a.example"}, `kind "mtls-peer"`},
	} {
		_, err := Issue(dir, tt.req)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("Issue(%+v) = %v, want an error containing %q", tt.req, err, tt.want)
		}
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 5 {
		t.Errorf("refused requests wrote files: %d entries in the CA dir, want the 5 CA files", len(entries))
	}
}
