package operator

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
)

func writePolicy(t *testing.T, text string) string {
	t.Helper()
	f := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(f, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return f
}

// TestPolicyDefault: without a file only the operator's namespace is
// served.
func TestPolicyDefault(t *testing.T) {
	p, err := LoadPolicy("", "pivirt-system")
	if err != nil {
		t.Fatal(err)
	}
	w, _ := wantedOf(testMC(func(s *v1alpha1.ManagedCertificateSpec) {
		s.CommonName = "pitrust-admin"
		s.Type = v1alpha1.TypeMTLSClient
	}))
	if err := p.Allows("pivirt-system", w, v1alpha1.IssuerRef{}, ""); err != nil {
		t.Errorf("own namespace: %v", err)
	}
	if err := p.Allows("apps", w, v1alpha1.IssuerRef{}, ""); err == nil || !strings.Contains(err.Error(), "--policy") {
		t.Errorf("another namespace: %v, want refused naming --policy", err)
	}
}

// TestPolicyRules: a rule grants its namespaces the names it matches and
// nothing else; each refusal names what was not granted.
func TestPolicyRules(t *testing.T) {
	p, err := LoadPolicy(writePolicy(t, `
rules:
  - namespaces: ["web-*"]
    commonNames: ["*.web.pivirt.internal"]
    dnsNames: ["*.web.pivirt.internal", "localhost"]
    ipAddresses: ["10.1.0.0/16"]
    types: [mtls-server]
  - namespaces: ["agents"]
    commonNames: ["pivirt-agent-*"]
    dnsNames: ["agent.pivirt.internal"]
    types: [mtls-client]
    clusters: ["prod"]
    offline: true
`), "pivirt-system")
	if err != nil {
		t.Fatal(err)
	}
	web := func(f func(*v1alpha1.ManagedCertificateSpec)) wanted {
		w, err := wantedOf(testMC(func(s *v1alpha1.ManagedCertificateSpec) {
			s.CommonName, s.DNSNames, s.IPAddresses = "a.web.pivirt.internal", []string{"a.web.pivirt.internal", "localhost"}, []string{"10.1.2.3"}
			if f != nil {
				f(s)
			}
		}))
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	for _, tc := range []struct {
		ns   string
		w    wanted
		ref  v1alpha1.IssuerRef
		want string // "" allowed, else a part of the refusal
	}{
		{"web-a", web(nil), v1alpha1.IssuerRef{}, ""},
		{"web-a", web(func(s *v1alpha1.ManagedCertificateSpec) { s.CommonName = "pitrust-admin" }), v1alpha1.IssuerRef{}, "commonName pitrust-admin"},
		{"web-a", web(func(s *v1alpha1.ManagedCertificateSpec) { s.DNSNames = []string{"evil.example"} }), v1alpha1.IssuerRef{}, "dnsName evil.example"},
		{"web-a", web(func(s *v1alpha1.ManagedCertificateSpec) { s.IPAddresses = []string{"10.2.0.1"} }), v1alpha1.IssuerRef{}, "ipAddress 10.2.0.1"},
		{"web-a", web(func(s *v1alpha1.ManagedCertificateSpec) { s.Type = v1alpha1.TypeMTLSClient }), v1alpha1.IssuerRef{}, "type mtls-client"},
		{"web-a", web(nil), v1alpha1.IssuerRef{SecretName: "x1"}, "offline"},
		{"web-a", web(nil), v1alpha1.IssuerRef{URL: "https://elsewhere:8080"}, "https://elsewhere:8080"},
		{"web-a", web(nil), v1alpha1.IssuerRef{URL: "https://pitrust:8080"}, ""},
		{"apps", web(nil), v1alpha1.IssuerRef{}, "no rule"},
		{"agents", web(func(s *v1alpha1.ManagedCertificateSpec) {
			s.CommonName, s.DNSNames, s.IPAddresses, s.Type, s.Cluster = "pivirt-agent-n1", []string{"agent.pivirt.internal"}, nil, v1alpha1.TypeMTLSClient, "prod"
		}), v1alpha1.IssuerRef{SecretName: "x1"}, ""},
		{"agents", web(func(s *v1alpha1.ManagedCertificateSpec) {
			s.CommonName, s.DNSNames, s.IPAddresses, s.Type, s.Cluster = "pivirt-agent-n1", []string{"agent.pivirt.internal"}, nil, v1alpha1.TypeMTLSClient, "test"
		}), v1alpha1.IssuerRef{}, "cluster test"},
	} {
		err := p.Allows(tc.ns, tc.w, tc.ref, "https://pitrust:8080")
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s %s: refused: %v", tc.ns, tc.w.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s %s: %v, want a refusal naming %q", tc.ns, tc.w.name, err, tc.want)
		}
	}
}

// TestPolicyFileErrors: a bad file names the key and what to write.
func TestPolicyFileErrors(t *testing.T) {
	for text, want := range map[string]string{
		"rules: []\n":                    "no rules",
		"rules:\n  - commonNames: [x]\n": "namespaces is required",
		"rules:\n  - namespaces: [a]\n    ipAddresses: [10.0.0.1]\n": "CIDR",
		"rules:\n  - namespaces: [a]\n    types: [server]\n":         "types",
		"rules:\n  - namespaces: [a]\n    commonName: [x]\n":         "commonName",
		"rules:\n  - namespaces: [\"[\"]\n":                          "pattern",
	} {
		_, err := LoadPolicy(writePolicy(t, text), "own")
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: %v, want an error naming %q", text, err, want)
		}
	}
}
