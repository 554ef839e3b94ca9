package e2e_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/types/known/durationpb"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"pilab.hu/pivirt-agent/cmd/internal/kubetest"
	"pilab.hu/pivirt-agent/cmd/internal/operator/certz/v1alpha1"
	"pilab.hu/pivirt-agent/identity"
	pitrustv1 "pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/pitrust/v1/pitrustv1connect"
)

// operatorSA is the operator's ServiceAccount of deploy/operator/rbac.yaml:
// the test runs the operator with a token of that user, so that its rights
// are the manifests' and nothing more.
const (
	operatorNS    = "pivirt-system"
	operatorSA    = "system:serviceaccount:" + operatorNS + ":pitrust-operator"
	operatorToken = "pitrust-operator-e2e-token"
)

// kubeEnv is a real kube-apiserver with the operator's manifests applied,
// a PiTrust CA server, and operator processes.
type kubeEnv struct {
	c    *cluster
	kube *kubetest.Server
	kc   client.Client
	ca   *caServer
	cas  pitrustv1connect.CertificateServiceClient
	ops  []*operatorProc
}

type operatorProc struct {
	name    string
	log     string
	metrics string
	health  string
	args    []string
	proc    *proc
}

// startKubeEnv starts the API server, applies deploy/operator's manifests
// with client-go and starts the CA server.
func startKubeEnv(t *testing.T) *kubeEnv {
	t.Helper()
	needTools(t, "openssl")
	bins := buildBinaries(t)
	kube := kubetest.Start(t, kubetest.WithToken(operatorToken, operatorSA, "system:serviceaccounts", "system:serviceaccounts:"+operatorNS))
	root := repoRoot
	manifests := filepath.Join(root, "deploy", "operator")
	applyManifests(t, kube.Config,
		filepath.Join(manifests, "namespace.yaml"),
		filepath.Join(manifests, "crd", "certz.pilab.hu_managedcertificates.yaml"),
		filepath.Join(manifests, "rbac.yaml"),
		filepath.Join(manifests, "deployment.yaml"))
	c := &cluster{bins: bins, dir: t.TempDir()}
	t.Cleanup(c.stopAll)
	e := &kubeEnv{c: c, kube: kube, kc: kubeClient(t, kube.Config)}
	e.ca = startCAServer(t, c)
	e.cas = e.caClient(t)
	return e
}

// caClient is the test's admin client of the CA server.
func (e *kubeEnv) caClient(t *testing.T) pitrustv1connect.CertificateServiceClient {
	t.Helper()
	pem, err := os.ReadFile(filepath.Join(e.ca.dir, identity.ChainFile))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	admin, err := tls.LoadX509KeyPair(filepath.Join(e.ca.dir, "pitrust-admin.crt"), filepath.Join(e.ca.dir, "pitrust-admin.key"))
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{admin}, ServerName: "127.0.0.1", MinVersion: tls.VersionTLS12}, ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return pitrustv1connect.NewCertificateServiceClient(&http.Client{Transport: tr, Timeout: 30 * time.Second}, e.ca.url)
}

// startOperator starts one pitrust operator process (a replica) with the
// ServiceAccount's token and extra flags.
func (e *kubeEnv) startOperator(t *testing.T, extra ...string) *operatorProc {
	t.Helper()
	ports, err := freePorts(2)
	if err != nil {
		t.Fatal(err)
	}
	o := &operatorProc{
		name:    fmt.Sprintf("operator%d", len(e.ops)+1),
		metrics: "127.0.0.1:" + strconv.Itoa(ports[0]),
		health:  "127.0.0.1:" + strconv.Itoa(ports[1]),
	}
	o.log = filepath.Join(e.c.dir, o.name+".log")
	o.args = append([]string{"operator",
		"--kubeconfig", e.kube.KubeconfigFor(operatorToken),
		"--namespace", operatorNS,
		"--ca-server", e.ca.url,
		"--ca-bundle", filepath.Join(e.ca.dir, identity.ChainFile),
		"--metrics-addr", o.metrics, "--health-addr", o.health,
		"--lease-duration", "4s", "--retry-min", "500ms", "--retry-max", "4s", "--revocation-delay", "2s",
	}, extra...)
	e.ops = append(e.ops, o)
	e.startOp(t, o)
	return o
}

func (e *kubeEnv) startOp(t *testing.T, o *operatorProc) {
	t.Helper()
	p, err := e.c.spawn(o.log, e.c.bins.pitrust, o.args)
	if err != nil {
		t.Fatal(err)
	}
	o.proc = p
	waitFor(t, 60*time.Second, o.name+" ready", func() error {
		if p.exited() {
			t.Fatalf("%s exited (%s); log:\n%s", o.name, p.state(), tail(o.log, 40))
		}
		resp, err := http.Get("http://" + o.health + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz: %s", resp.Status)
		}
		return nil
	})
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s log:\n%s", o.name, tail(o.log, 60))
		}
	})
}

// adminCert makes the operator's pitrust-admin credential files (the
// harness's CA server gives that role to the CN pitrust-admin).
func (e *kubeEnv) adminFlags() []string {
	return []string{"--cert", filepath.Join(e.ca.dir, "pitrust-admin.crt"), "--key", filepath.Join(e.ca.dir, "pitrust-admin.key")}
}

// leader is the operator replica holding the Lease.
func (e *kubeEnv) leader(t *testing.T) *operatorProc {
	t.Helper()
	var leader *operatorProc
	waitFor(t, 60*time.Second, "a leader", func() error {
		var l coordinationv1.Lease
		if err := e.kc.Get(context.Background(), types.NamespacedName{Namespace: operatorNS, Name: "pitrust-operator.certz.pilab.hu"}, &l); err != nil {
			return err
		}
		if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
			return fmt.Errorf("the Lease has no holder")
		}
		for _, o := range e.ops {
			if o.proc != nil && !o.proc.exited() && strings.HasPrefix(*l.Spec.HolderIdentity, hostname()+"_") && e.metricValue(o, "leader_election_master_status") == 1 {
				leader = o
				return nil
			}
		}
		return fmt.Errorf("holder %s is none of the running replicas", *l.Spec.HolderIdentity)
	})
	return leader
}

func hostname() string {
	h, _ := os.Hostname()
	return h
}

// metricValue is the sum of a metric's series on an operator's /metrics
// (-1 when it cannot be read).
func (e *kubeEnv) metricValue(o *operatorProc, name string, labels ...string) float64 {
	resp, err := http.Get("http://" + o.metrics + "/metrics")
	if err != nil {
		return -1
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	sum, found := 0.0, false
	for line := range strings.SplitSeq(string(b), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		ok := true
		for _, l := range labels {
			ok = ok && strings.Contains(line, l)
		}
		if !ok {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err == nil {
			sum, found = sum+v, true
		}
	}
	if !found {
		return 0
	}
	return sum
}

// mc returns a ManagedCertificate.
func (e *kubeEnv) mc(t *testing.T, ns, name string) *v1alpha1.ManagedCertificate {
	t.Helper()
	var m v1alpha1.ManagedCertificate
	if err := e.kc.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &m); err != nil {
		t.Fatal(err)
	}
	return &m
}

// waitReady waits until the resource is Ready at a revision of at least
// rev and returns it.
func (e *kubeEnv) waitReady(t *testing.T, ns, name string, rev int64, timeout time.Duration) *v1alpha1.ManagedCertificate {
	t.Helper()
	var m *v1alpha1.ManagedCertificate
	waitFor(t, timeout, fmt.Sprintf("ManagedCertificate %s/%s Ready at revision ≥ %d", ns, name, rev), func() error {
		m = e.mc(t, ns, name)
		c := meta.FindStatusCondition(m.Status.Conditions, v1alpha1.ConditionReady)
		if c == nil || c.Status != metav1.ConditionTrue || m.Status.Revision < rev {
			return fmt.Errorf("status %s", describe(m.Status))
		}
		return nil
	})
	return m
}

// secret reads a Secret.
func (e *kubeEnv) secret(t *testing.T, ns, name string) *corev1.Secret {
	t.Helper()
	var s corev1.Secret
	if err := e.kc.Get(context.Background(), types.NamespacedName{Namespace: ns, Name: name}, &s); err != nil {
		t.Fatal(err)
	}
	return &s
}

// inventory lists the CA server's certificates of a CN.
func (e *kubeEnv) inventory(t *testing.T, cn string) []*pitrustv1.Certificate {
	t.Helper()
	resp, err := e.cas.ListCertificates(context.Background(), connect.NewRequest(&pitrustv1.ListCertificatesRequest{Name: cn}))
	if err != nil {
		t.Fatal(err)
	}
	return resp.Msg.GetCertificates()
}

func statusOf(certs []*pitrustv1.Certificate, serial string) string {
	for _, c := range certs {
		if strings.EqualFold(strings.ReplaceAll(c.GetSerial(), ":", ""), serial) {
			return c.GetStatus()
		}
	}
	return "absent"
}

// writeSecretFiles writes the Secret's keys into a new directory.
func writeSecretFiles(t *testing.T, s *corev1.Secret) string {
	t.Helper()
	dir := t.TempDir()
	for k, v := range s.Data {
		if err := os.WriteFile(filepath.Join(dir, k), v, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// TestOperator runs pitrust operator against a real kube-apiserver with
// the repository's manifests applied as they are: two replicas, one
// issuing (a Lease); the specification's example becomes a Secret that
// openssl verifies against the PiTrust chain; invalid resources are
// refused by the schema naming the field; a short-lived certificate is
// renewed in place with a new key (its predecessor revoked) while a client
// keeps a TLS connection open to a server reading the projected files,
// without a failed request; a tampered or deleted Secret and a changed
// spec are issued again; the leader's death hands over without a second
// issuance; the CA server down gives Ready=False with the reason and
// recovers by itself; a deleted resource's certificate is revoked; an
// offline issuer signs from a Secret.
func TestOperator(t *testing.T) {
	e := startKubeEnv(t)
	ctx := context.Background()
	op1 := e.startOperator(t, e.adminFlags()...)
	op2 := e.startOperator(t, e.adminFlags()...)

	t.Run("example", func(t *testing.T) {
		applyManifests(t, e.kube.Config, filepath.Join(repoRoot, "deploy", "operator", "example.yaml"))
		m := e.waitReady(t, operatorNS, "agent-tls", 1, 60*time.Second)
		s := e.secret(t, operatorNS, "agent-tls-secret")
		if s.Type != corev1.SecretTypeTLS {
			t.Errorf("Secret type %s, want %s", s.Type, corev1.SecretTypeTLS)
		}
		dir := writeSecretFiles(t, s)
		leaf := filepath.Join(dir, "leaf.pem")
		certs, err := identity.ParseCertificates(s.Data["tls.crt"])
		if err != nil || len(certs) != 2 {
			t.Fatalf("tls.crt: %d certificates, %v; want the leaf and the X1 intermediate", len(certs), err)
		}
		if err := os.WriteFile(leaf, s.Data["tls.crt"][:strings.Index(string(s.Data["tls.crt"]), "-----END CERTIFICATE-----")+len("-----END CERTIFICATE-----\n")], 0o600); err != nil {
			t.Fatal(err)
		}
		out := openssl(t, "verify", "-CAfile", filepath.Join(e.ca.dir, identity.RootCertFile), "-untrusted", filepath.Join(dir, "tls.crt"),
			"-purpose", "sslserver", "-verify_hostname", "agent.pivirt.svc.cluster.local", leaf)
		if !strings.Contains(out, ": OK") {
			t.Errorf("openssl verify: %s", out)
		}
		out = openssl(t, "verify", "-CAfile", filepath.Join(dir, "ca.crt"), leaf)
		if !strings.Contains(out, ": OK") {
			t.Errorf("openssl verify against ca.crt: %s", out)
		}
		if _, err := tls.X509KeyPair(s.Data["tls.crt"], s.Data["tls.key"]); err != nil {
			t.Errorf("tls.crt and tls.key: %v", err)
		}
		life := time.Until(certs[0].NotAfter)
		if life < 8750*time.Hour || life > 8761*time.Hour {
			t.Errorf("the certificate lives %s more, want duration 8760h", life)
		}
		if want := certs[0].NotAfter.Add(-720 * time.Hour); !m.Status.RenewalTime.Time.Equal(want.Truncate(time.Second)) && m.Status.RenewalTime.Time.Sub(want).Abs() > time.Second {
			t.Errorf("renewalTime %s, want 720h before expiry (%s)", m.Status.RenewalTime, want)
		}
		if len(s.OwnerReferences) != 1 || s.OwnerReferences[0].UID != m.UID || s.OwnerReferences[0].Controller == nil || !*s.OwnerReferences[0].Controller {
			t.Errorf("Secret owner references %+v, want the ManagedCertificate %s as controller", s.OwnerReferences, m.UID)
		}
		// The issuance is an event of the resource (kubectl describe).
		waitFor(t, 30*time.Second, "an Issued event of agent-tls", func() error {
			var evs eventsv1.EventList
			if err := e.kc.List(ctx, &evs, client.InNamespace(operatorNS)); err != nil {
				return err
			}
			for _, ev := range evs.Items {
				if ev.Regarding.Name == "agent-tls" && ev.Reason == "Issued" && strings.Contains(ev.Note, m.Status.SerialNumber) {
					return nil
				}
			}
			return fmt.Errorf("no Issued event naming serial %s among %d events", m.Status.SerialNumber, len(evs.Items))
		})
		// Two replicas, one issuance.
		if inv := e.inventory(t, "agent.pivirt.svc.cluster.local"); len(inv) != 1 {
			t.Errorf("the CA server issued %d certificates for the example, want 1 (two replicas): %v", len(inv), inv)
		}
		leader := e.leader(t)
		if v := e.metricValue(leader, "pitrust_operator_certificate_ready", `name="agent-tls"`); v != 1 {
			t.Errorf("leader's pitrust_operator_certificate_ready{name=agent-tls} = %v, want 1", v)
		}
		if v := e.metricValue(leader, "pitrust_operator_certificate_expiration_timestamp_seconds", `name="agent-tls"`); int64(v) != certs[0].NotAfter.Unix() {
			t.Errorf("expiration metric %v, want %d", v, certs[0].NotAfter.Unix())
		}
		for _, o := range []*operatorProc{op1, op2} {
			resp, err := http.Get("http://" + o.health + "/healthz")
			if err != nil || resp.StatusCode != 200 {
				t.Errorf("%s /healthz: %v %v", o.name, resp, err)
			} else {
				resp.Body.Close()
			}
		}
		if _, err := exec.LookPath("kubectl"); err == nil {
			out, err := exec.Command("kubectl", "--kubeconfig", e.kube.Kubeconfig, "get", "managedcertificates", "-n", operatorNS).CombinedOutput()
			t.Logf("kubectl get managedcertificates:\n%s", out)
			if err != nil || !strings.Contains(string(out), "READY") || !strings.Contains(string(out), "agent-tls-secret") || !strings.Contains(string(out), "True") {
				t.Errorf("kubectl get managedcertificates: %v\n%s", err, out)
			}
		}
	})

	t.Run("schema", func(t *testing.T) {
		for _, tc := range []struct {
			name  string
			spec  v1alpha1.ManagedCertificateSpec
			field string
		}{
			{"bad-ip", v1alpha1.ManagedCertificateSpec{CommonName: "x", SecretName: "x", IPAddresses: []string{"not-an-ip"}}, "spec.ipAddresses[0]"},
			{"short", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x", Duration: &metav1.Duration{Duration: 30 * time.Second}}, "spec.duration"},
			{"bad-type", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x", Type: "tls-server"}, "spec.type"},
			{"no-secret", v1alpha1.ManagedCertificateSpec{CommonName: "x.example"}, "spec.secretName"},
			{"two-issuers", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x", IssuerRef: &v1alpha1.IssuerRef{URL: "https://a:1", SecretName: "b"}}, "spec.issuerRef"},
			{"http-issuer", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x", IssuerRef: &v1alpha1.IssuerRef{URL: "http://a:1"}}, "spec.issuerRef.url"},
			{"rsa-size", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x", PrivateKey: &v1alpha1.PrivateKey{Algorithm: "RSA", Size: 1024}}, "spec.privateKey"},
			{"server-without-names", v1alpha1.ManagedCertificateSpec{CommonName: "x_y", SecretName: "x"}, "the server usage needs dnsNames"},
			{"usages-without-own", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x", Usages: []v1alpha1.Usage{"client"}}, "usages must hold the type's own usage"},
			{"secret-is-issuer", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x1", IssuerRef: &v1alpha1.IssuerRef{SecretName: "x1"}}, "must not be the issuer's Secret"},
			{"template-operator-key", v1alpha1.ManagedCertificateSpec{CommonName: "x.example", SecretName: "x",
				SecretTemplate: &v1alpha1.SecretTemplate{Annotations: map[string]string{"certz.pilab.hu/serial": "DEADBEEF"}}}, "spec.secretTemplate"},
		} {
			m := &v1alpha1.ManagedCertificate{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: tc.name}, Spec: tc.spec}
			err := e.kc.Create(ctx, m)
			if err == nil {
				t.Errorf("%s: created, want refused naming %s", tc.name, tc.field)
				continue
			}
			if !strings.Contains(err.Error(), tc.field) {
				t.Errorf("%s: refused with %q, want it to name %s", tc.name, err, tc.field)
			}
			t.Logf("%s: %v", tc.name, err)
		}
	})

	t.Run("renewal", func(t *testing.T) {
		m := &v1alpha1.ManagedCertificate{
			ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "short"},
			Spec: v1alpha1.ManagedCertificateSpec{
				CommonName: "short.pivirt.internal", SecretName: "short-tls", DNSNames: []string{"localhost"}, IPAddresses: []string{"127.0.0.1"},
				Duration: &metav1.Duration{Duration: 90 * time.Second}, RevocationPolicy: v1alpha1.RevokeOnRenewal,
			},
		}
		if err := e.kc.Create(ctx, m); err != nil {
			t.Fatal(err)
		}
		first := e.waitReady(t, operatorNS, "short", 1, 60*time.Second)
		if want := first.Status.NotAfter.Add(-30 * time.Second); first.Status.RenewalTime.Sub(want).Abs() > time.Second {
			t.Errorf("renewalTime %s, want notAfter - duration/3 = %s (renewBefore ≥ duration)", first.Status.RenewalTime, want)
		}
		// A server reading the projected Secret, and a client that keeps
		// one connection open while another connects for each request.
		pctx, cancel := context.WithCancel(ctx)
		defer cancel()
		dir := filepath.Join(t.TempDir(), "short-tls")
		projectSecret(pctx, t, e.kc, types.NamespacedName{Namespace: operatorNS, Name: "short-tls"}, dir)
		src, err := identity.NewSource(identity.SourceConfig{CertFile: filepath.Join(dir, "tls.crt"), KeyFile: filepath.Join(dir, "tls.key"), CAFile: filepath.Join(dir, "ca.crt")})
		if err != nil {
			t.Fatal(err)
		}
		go src.Watch(pctx, 100*time.Millisecond)
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok") }), TLSConfig: src.ServerConfig(tls.NoClientCert, nil)}
		go srv.ServeTLS(ln, "", "")
		defer srv.Close()
		roots := x509.NewCertPool()
		roots.AppendCertsFromPEM(e.secret(t, operatorNS, "short-tls").Data["ca.crt"])
		url := "https://localhost:" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port) + "/"
		kept := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, MaxConnsPerHost: 1, IdleConnTimeout: time.Hour}
		fresh := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}, DisableKeepAlives: true}
		var ok, failed, conns atomic.Int64
		var firstErr atomic.Value
		serials := map[string]bool{}
		var serialsMu sync.Mutex
		kept.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conns.Add(1)
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		}
		done := make(chan struct{})
		stop := make(chan struct{})
		go func() {
			defer close(done)
			for {
				select {
				case <-stop:
					return
				case <-time.After(50 * time.Millisecond):
				}
				for _, tr := range []*http.Transport{kept, fresh} {
					resp, err := (&http.Client{Transport: tr, Timeout: 5 * time.Second}).Get(url)
					if err != nil {
						failed.Add(1)
						firstErr.CompareAndSwap(nil, err.Error())
						continue
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					ok.Add(1)
					if tr == fresh && resp.TLS != nil {
						serialsMu.Lock()
						serials[identity.SerialHex(resp.TLS.PeerCertificates[0].SerialNumber)] = true
						serialsMu.Unlock()
					}
				}
			}
		}()
		second := e.waitReady(t, operatorNS, "short", 2, 120*time.Second)
		if second.Status.SerialNumber == first.Status.SerialNumber {
			t.Fatalf("revision 2 kept serial %s", first.Status.SerialNumber)
		}
		// The server takes up the new files: new handshakes see the new
		// serial.
		waitFor(t, 30*time.Second, "the server presents the renewed certificate", func() error {
			serialsMu.Lock()
			defer serialsMu.Unlock()
			if !serials[second.Status.SerialNumber] {
				return fmt.Errorf("serials seen %v, want %s", serials, second.Status.SerialNumber)
			}
			return nil
		})
		close(stop)
		<-done
		serialsMu.Lock()
		t.Logf("renewal: %d requests ok, %d failed, the kept connection dialled %d time(s); serials %v", ok.Load(), failed.Load(), conns.Load(), serials)
		serialsMu.Unlock()
		if failed.Load() != 0 {
			t.Errorf("%d requests failed across the renewal (first: %v), want 0", failed.Load(), firstErr.Load())
		}
		if conns.Load() != 1 {
			t.Errorf("the kept connection was dialled %d times, want once (held open across the renewal)", conns.Load())
		}
		// The predecessor is revoked (revocationPolicy OnRenewal).
		waitFor(t, 30*time.Second, "the renewed certificate's predecessor revoked", func() error {
			if st := statusOf(e.inventory(t, "short.pivirt.internal"), first.Status.SerialNumber); st != "revoked" {
				return fmt.Errorf("serial %s is %s", first.Status.SerialNumber, st)
			}
			return nil
		})
		cancel()
	})

	t.Run("reissue", func(t *testing.T) {
		m := &v1alpha1.ManagedCertificate{
			ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "web"},
			Spec: v1alpha1.ManagedCertificateSpec{
				CommonName: "web.pivirt.internal", SecretName: "web-tls", DNSNames: []string{"web.pivirt.internal"},
				SecretTemplate: &v1alpha1.SecretTemplate{Labels: map[string]string{"app": "web"}, Annotations: map[string]string{"team": "infra"}},
				PrivateKey:     &v1alpha1.PrivateKey{Algorithm: "RSA", Size: 3072},
			},
		}
		if err := e.kc.Create(ctx, m); err != nil {
			t.Fatal(err)
		}
		r1 := e.waitReady(t, operatorNS, "web", 1, 60*time.Second)
		s := e.secret(t, operatorNS, "web-tls")
		if s.Labels["app"] != "web" || s.Annotations["team"] != "infra" {
			t.Errorf("Secret labels %v annotations %v, want the template's", s.Labels, s.Annotations)
		}
		pair, err := tls.X509KeyPair(s.Data["tls.crt"], s.Data["tls.key"])
		if err != nil {
			t.Fatal(err)
		}
		if k, ok := pair.Leaf.PublicKey.(interface{ Size() int }); !ok || k.Size() != 3072/8 {
			t.Errorf("key %T, want RSA 3072", pair.Leaf.PublicKey)
		}
		// Tampered: a key that is not the certificate's.
		other := e.secret(t, operatorNS, "agent-tls-secret")
		s.Data["tls.key"] = other.Data["tls.key"]
		if err := e.kc.Update(ctx, s); err != nil {
			t.Fatal(err)
		}
		r2 := e.waitReady(t, operatorNS, "web", 2, 60*time.Second)
		if r2.Status.SerialNumber == r1.Status.SerialNumber {
			t.Errorf("tampered Secret: serial unchanged")
		}
		waitFor(t, 30*time.Second, "the tampered Secret's certificate revoked", func() error {
			if st := statusOf(e.inventory(t, "web.pivirt.internal"), r1.Status.SerialNumber); st != "revoked" {
				return fmt.Errorf("serial %s is %s", r1.Status.SerialNumber, st)
			}
			return nil
		})
		// Deleted.
		if err := e.kc.Delete(ctx, e.secret(t, operatorNS, "web-tls")); err != nil {
			t.Fatal(err)
		}
		r3 := e.waitReady(t, operatorNS, "web", 3, 60*time.Second)
		// The spec changes: a new name.
		m = e.mc(t, operatorNS, "web")
		m.Spec.DNSNames = append(m.Spec.DNSNames, "www.pivirt.internal")
		if err := e.kc.Update(ctx, m); err != nil {
			t.Fatal(err)
		}
		r4 := e.waitReady(t, operatorNS, "web", 4, 60*time.Second)
		pair, err = tls.X509KeyPair(e.secret(t, operatorNS, "web-tls").Data["tls.crt"], e.secret(t, operatorNS, "web-tls").Data["tls.key"])
		if err != nil {
			t.Fatal(err)
		}
		if len(pair.Leaf.DNSNames) != 2 {
			t.Errorf("DNS names %v after the spec change, want both", pair.Leaf.DNSNames)
		}
		waitFor(t, 30*time.Second, "the certificate replaced by a spec change revoked (after --revocation-delay)", func() error {
			if got := statusOf(e.inventory(t, "web.pivirt.internal"), r3.Status.SerialNumber); got != "revoked" {
				return fmt.Errorf("serial %s is %s", r3.Status.SerialNumber, got)
			}
			return nil
		})
		if r4.Status.ObservedGeneration != r4.Generation {
			t.Errorf("observedGeneration %d, generation %d", r4.Status.ObservedGeneration, r4.Generation)
		}
		// A renewal asked for by hand (the key rotated now): a new key, and
		// the certificate it replaces revoked.
		oldKey := e.secret(t, operatorNS, "web-tls").Data["tls.key"]
		m = e.mc(t, operatorNS, "web")
		m.Annotations = map[string]string{"certz.pilab.hu/renew": "1"}
		if err := e.kc.Update(ctx, m); err != nil {
			t.Fatal(err)
		}
		e.waitReady(t, operatorNS, "web", 5, 60*time.Second)
		if string(e.secret(t, operatorNS, "web-tls").Data["tls.key"]) == string(oldKey) {
			t.Error("a requested renewal kept the key")
		}
		waitFor(t, 30*time.Second, "the certificate replaced on request revoked", func() error {
			if st := statusOf(e.inventory(t, "web.pivirt.internal"), r4.Status.SerialNumber); st != "revoked" {
				return fmt.Errorf("serial %s is %s", r4.Status.SerialNumber, st)
			}
			return nil
		})
		// A Secret of another resource is not taken.
		clash := &v1alpha1.ManagedCertificate{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "clash"},
			Spec: v1alpha1.ManagedCertificateSpec{CommonName: "clash.pivirt.internal", SecretName: "web-tls"}}
		if err := e.kc.Create(ctx, clash); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 30*time.Second, "a ManagedCertificate naming another's Secret is refused", func() error {
			c := meta.FindStatusCondition(e.mc(t, operatorNS, "clash").Status.Conditions, v1alpha1.ConditionReady)
			if c == nil || c.Status != metav1.ConditionFalse || c.Reason != "SecretInUse" || !strings.Contains(c.Message, "web") {
				return fmt.Errorf("Ready %+v", c)
			}
			return nil
		})
		if err := e.kc.Delete(ctx, clash); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("not-taken", func(t *testing.T) {
		// A Secret the operator did not make is not taken over, and
		// another namespace is refused by the default policy.
		if err := e.kc.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "db-password"}, StringData: map[string]string{"password": "hunter2"}}); err != nil {
			t.Fatal(err)
		}
		if err := e.kc.Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "apps"}}); err != nil {
			t.Fatal(err)
		}
		for _, m := range []*v1alpha1.ManagedCertificate{
			{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "db"}, Spec: v1alpha1.ManagedCertificateSpec{CommonName: "db.pivirt.internal", SecretName: "db-password"}},
			{ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "admin"}, Spec: v1alpha1.ManagedCertificateSpec{CommonName: "pitrust-admin", Type: v1alpha1.TypeMTLSClient, SecretName: "admin-tls"}},
		} {
			if err := e.kc.Create(ctx, m); err != nil {
				t.Fatal(err)
			}
		}
		for _, c := range []struct{ ns, name, reason, words string }{
			{operatorNS, "db", "SecretInUse", "was not made by the operator"},
			{"apps", "admin", "PolicyDenied", "--policy"},
		} {
			waitFor(t, 30*time.Second, c.ns+"/"+c.name+" refused", func() error {
				got := meta.FindStatusCondition(e.mc(t, c.ns, c.name).Status.Conditions, v1alpha1.ConditionReady)
				if got == nil || got.Status != metav1.ConditionFalse || got.Reason != c.reason || !strings.Contains(got.Message, c.words) {
					return fmt.Errorf("Ready %+v", got)
				}
				return nil
			})
		}
		if s := e.secret(t, operatorNS, "db-password"); string(s.Data["password"]) != "hunter2" || len(s.Labels) != 0 {
			t.Errorf("the foreign Secret was changed: %v %v", s.Labels, s.Data)
		}
		if inv := e.inventory(t, "pitrust-admin"); len(inv) != 1 {
			t.Errorf("%d certificates of pitrust-admin, want the harness's one", len(inv))
		}
		for _, m := range []struct{ ns, name string }{{operatorNS, "db"}, {"apps", "admin"}} {
			if err := e.kc.Delete(ctx, e.mc(t, m.ns, m.name)); err != nil {
				t.Fatal(err)
			}
		}
	})

	t.Run("failover", func(t *testing.T) {
		leader := e.leader(t)
		before := e.mc(t, operatorNS, "agent-tls").Status.Revision
		leader.proc.cmd.Process.Kill()
		<-leader.proc.done
		m := &v1alpha1.ManagedCertificate{
			ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "after-failover"},
			Spec:       v1alpha1.ManagedCertificateSpec{CommonName: "after-failover.pivirt.internal", SecretName: "after-failover-tls"},
		}
		if err := e.kc.Create(ctx, m); err != nil {
			t.Fatal(err)
		}
		e.waitReady(t, operatorNS, "after-failover", 1, 60*time.Second)
		if inv := e.inventory(t, "after-failover.pivirt.internal"); len(inv) != 1 {
			t.Errorf("%d certificates issued after the failover, want 1", len(inv))
		}
		// The killed replica comes back: nothing is issued again. The new
		// leader has looked at the example (its gauge says so) first.
		e.startOp(t, leader)
		now := e.leader(t)
		waitFor(t, 30*time.Second, "the new leader reconciled the example", func() error {
			if v := e.metricValue(now, "pitrust_operator_certificate_ready", `name="agent-tls"`); v != 1 {
				return fmt.Errorf("pitrust_operator_certificate_ready{name=agent-tls} = %v on %s", v, now.name)
			}
			return nil
		})
		if got := e.mc(t, operatorNS, "agent-tls").Status.Revision; got != before {
			t.Errorf("agent-tls revision %d after the failover and restart, want %d", got, before)
		}
		if inv := e.inventory(t, "agent.pivirt.svc.cluster.local"); len(inv) != 1 {
			t.Errorf("the example has %d certificates after the failover and restart, want 1", len(inv))
		}
	})

	t.Run("ca-down", func(t *testing.T) {
		e.ca.stop(t)
		m := &v1alpha1.ManagedCertificate{
			ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "while-down"},
			Spec:       v1alpha1.ManagedCertificateSpec{CommonName: "while-down.pivirt.internal", SecretName: "while-down-tls"},
		}
		if err := e.kc.Create(ctx, m); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 60*time.Second, "Ready=False with the reason, retried", func() error {
			m := e.mc(t, operatorNS, "while-down")
			c := meta.FindStatusCondition(m.Status.Conditions, v1alpha1.ConditionReady)
			if c == nil || c.Status != metav1.ConditionFalse || c.Reason != "IssuerUnavailable" || !strings.Contains(c.Message, "cannot be reached") || m.Status.FailedIssuanceAttempts < 3 || m.Status.LastFailureTime == nil {
				return fmt.Errorf("status %s", describe(m.Status))
			}
			t.Logf("CA server down: Ready=False %s: %s (attempts %d)", c.Reason, c.Message, m.Status.FailedIssuanceAttempts)
			return nil
		})
		e.ca.start(t, e.c)
		m = e.waitReady(t, operatorNS, "while-down", 1, 60*time.Second)
		if m.Status.FailedIssuanceAttempts != 0 || m.Status.LastFailureTime != nil {
			t.Errorf("after recovery: failures %d at %v, want cleared", m.Status.FailedIssuanceAttempts, m.Status.LastFailureTime)
		}
		e.cas = e.caClient(t)
	})

	t.Run("delete-revokes", func(t *testing.T) {
		serial := e.mc(t, operatorNS, "while-down").Status.SerialNumber
		if err := e.kc.Delete(ctx, e.mc(t, operatorNS, "while-down")); err != nil {
			t.Fatal(err)
		}
		waitFor(t, 30*time.Second, "the deleted resource gone and its certificate revoked", func() error {
			var m v1alpha1.ManagedCertificate
			if err := e.kc.Get(ctx, types.NamespacedName{Namespace: operatorNS, Name: "while-down"}, &m); err == nil {
				return fmt.Errorf("still there (finalizers %v)", m.Finalizers)
			}
			if st := statusOf(e.inventory(t, "while-down.pivirt.internal"), serial); st != "revoked" {
				return fmt.Errorf("serial %s is %s", serial, st)
			}
			return nil
		})
	})

	t.Run("bootstrap-token", func(t *testing.T) { testOperatorBootstrap(t, e) })

	t.Run("offline", func(t *testing.T) {
		data := map[string][]byte{}
		for _, f := range []string{identity.IntermediateCertFile, identity.IntermediateKeyFile, identity.ChainFile} {
			b, err := os.ReadFile(filepath.Join(e.ca.dir, f))
			if err != nil {
				t.Fatal(err)
			}
			data[f] = b
		}
		if err := e.kc.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "pitrust-x1"}, Data: data}); err != nil {
			t.Fatal(err)
		}
		m := &v1alpha1.ManagedCertificate{
			ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "offline"},
			Spec: v1alpha1.ManagedCertificateSpec{CommonName: "offline.pivirt.internal", Type: "mtls-client", SecretName: "offline-tls",
				IssuerRef: &v1alpha1.IssuerRef{SecretName: "pitrust-x1"}, PrivateKey: &v1alpha1.PrivateKey{Algorithm: "Ed25519"}},
		}
		if err := e.kc.Create(ctx, m); err != nil {
			t.Fatal(err)
		}
		e.waitReady(t, operatorNS, "offline", 1, 60*time.Second)
		dir := writeSecretFiles(t, e.secret(t, operatorNS, "offline-tls"))
		out := openssl(t, "verify", "-CAfile", filepath.Join(e.ca.dir, identity.RootCertFile), "-untrusted", filepath.Join(dir, "tls.crt"), "-purpose", "sslclient", filepath.Join(dir, "tls.crt"))
		if !strings.Contains(out, ": OK") {
			t.Errorf("openssl verify of the offline certificate: %s", out)
		}
		if inv := e.inventory(t, "offline.pivirt.internal"); len(inv) != 0 {
			t.Errorf("an offline issuance reached the CA server's inventory: %v", inv)
		}
	})
}

// testOperatorBootstrap replaces the replicas with two that start from a
// one-time bootstrap token: the leader redeems it for the operator's
// certificate and keeps it in the credentials Secret, from which the other
// replica works once it leads (the token being spent).
func testOperatorBootstrap(t *testing.T, e *kubeEnv) {
	ctx := context.Background()
	for _, o := range e.ops {
		if o.proc != nil && !o.proc.exited() {
			o.proc.cancel()
			<-o.proc.done
		}
	}
	tok, err := e.cas.CreateBootstrapToken(ctx, connect.NewRequest(&pitrustv1.CreateBootstrapTokenRequest{
		Name: "pitrust-admin", Kind: "mtls-client", Ttl: durationpb.New(time.Hour),
	}))
	if err != nil {
		t.Fatal(err)
	}
	tokenFile := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tokenFile, []byte(tok.Msg.GetToken()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	e.startOperator(t, "--bootstrap-token-file", tokenFile)
	e.startOperator(t, "--bootstrap-token-file", tokenFile)
	m := &v1alpha1.ManagedCertificate{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "boot"},
		Spec: v1alpha1.ManagedCertificateSpec{CommonName: "boot.pivirt.internal", SecretName: "boot-tls"}}
	if err := e.kc.Create(ctx, m); err != nil {
		t.Fatal(err)
	}
	e.waitReady(t, operatorNS, "boot", 1, 60*time.Second)
	cred := e.secret(t, operatorNS, "pitrust-operator-credentials")
	pair, err := tls.X509KeyPair(cred.Data["tls.crt"], cred.Data["tls.key"])
	if err != nil || pair.Leaf.Subject.CommonName != "pitrust-admin" {
		t.Fatalf("the credentials Secret: %v %v", err, pair.Leaf)
	}
	leader := e.leader(t)
	leader.proc.cmd.Process.Kill()
	<-leader.proc.done
	m = &v1alpha1.ManagedCertificate{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: "boot2"},
		Spec: v1alpha1.ManagedCertificateSpec{CommonName: "boot2.pivirt.internal", SecretName: "boot2-tls"}}
	if err := e.kc.Create(ctx, m); err != nil {
		t.Fatal(err)
	}
	e.waitReady(t, operatorNS, "boot2", 1, 60*time.Second)
	if inv := e.inventory(t, "pitrust-admin"); len(inv) != 2 {
		// The harness's own admin certificate and the operator's one.
		t.Errorf("%d certificates of pitrust-admin, want 2 (the token redeemed once)", len(inv))
	}
}

// TestOperatorAgentCluster starts three pivirt-agents whose every
// certificate is a ManagedCertificate's Secret, projected into files as the
// kubelet projects a secret volume: they form a cluster, and keep serving
// reads and forwarded writes without a failed request while the operator
// renews their one-minute certificates in place, twice; deleting a
// resource revokes its certificate, and every agent then refuses it.
func TestOperatorAgentCluster(t *testing.T) {
	e := startKubeEnv(t)
	e.startOperator(t, e.adminFlags()...)
	ctx := context.Background()
	c := e.c
	c.name = fmt.Sprintf("e2e-%08x", mrand.Uint32())
	pctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	type want struct {
		name string
		spec v1alpha1.ManagedCertificateSpec
	}
	var wants []want
	minute := &metav1.Duration{Duration: 90 * time.Second}
	for i := 1; i <= 3; i++ {
		n := fmt.Sprintf("node%d", i)
		wants = append(wants,
			want{n + "-server", v1alpha1.ManagedCertificateSpec{CommonName: n + "-server", Type: v1alpha1.TypeMTLSServer,
				DNSNames: []string{"localhost"}, IPAddresses: []string{"127.0.0.1"}, Duration: minute}},
			want{"pivirt-agent-" + n, v1alpha1.ManagedCertificateSpec{CommonName: "pivirt-agent-" + n, Type: v1alpha1.TypeMTLSClient,
				DNSNames: []string{"agent.pivirt.internal"}, Cluster: c.name, Duration: minute}})
	}
	wants = append(wants,
		want{"operator", v1alpha1.ManagedCertificateSpec{CommonName: "operator", Type: v1alpha1.TypeMTLSClient}},
		want{"operator-leaked", v1alpha1.ManagedCertificateSpec{CommonName: "operator", Type: v1alpha1.TypeMTLSClient}})
	for _, w := range wants {
		w.spec.SecretName = w.name + "-tls"
		if err := e.kc.Create(ctx, &v1alpha1.ManagedCertificate{ObjectMeta: metav1.ObjectMeta{Namespace: operatorNS, Name: w.name}, Spec: w.spec}); err != nil {
			t.Fatal(err)
		}
	}
	for _, w := range wants {
		e.waitReady(t, operatorNS, w.name, 1, 60*time.Second)
		dir := filepath.Join(e.ca.dir, "secrets", w.name)
		projectSecret(pctx, t, e.kc, types.NamespacedName{Namespace: operatorNS, Name: w.name + "-tls"}, dir)
		for ext, key := range map[string]string{".crt": "tls.crt", ".key": "tls.key"} {
			link := filepath.Join(e.ca.dir, w.name+ext)
			_ = os.Remove(link)
			if err := os.Symlink(filepath.Join(dir, key), link); err != nil {
				t.Fatal(err)
			}
		}
	}
	c.certs = e.ca.dir
	c.tlsExtra = "  revocation:\n    mode: both\n    on_unavailable: allow\n"
	startClusterOn(t, c)
	l := startLoad(t, c)

	// Two renewals of every one-minute certificate; each agent presents its
	// renewed server certificate.
	for _, w := range wants[:6] {
		e.waitReady(t, operatorNS, w.name, 3, 4*time.Minute)
	}
	roots := x509.NewCertPool()
	chain, err := os.ReadFile(filepath.Join(e.ca.dir, identity.ChainFile))
	if err != nil {
		t.Fatal(err)
	}
	roots.AppendCertsFromPEM(chain)
	for _, n := range c.nodes {
		c.eventually(t, 30*time.Second, n.name+" presents the renewed certificate", func() error {
			m := e.mc(t, operatorNS, n.name+"-server")
			conn, err := tls.Dial("tcp", n.api, &tls.Config{RootCAs: roots, ServerName: "localhost", MinVersion: tls.VersionTLS12, Certificates: c.clientTLS(t).Certificates})
			if err != nil {
				return err
			}
			defer conn.Close()
			got := identity.SerialHex(conn.ConnectionState().PeerCertificates[0].SerialNumber)
			if got != m.Status.SerialNumber {
				return fmt.Errorf("serial %s, the Secret's (revision %d) %s", got, m.Status.Revision, m.Status.SerialNumber)
			}
			return nil
		})
	}
	okN, failed, first := l.stop()
	t.Logf("load across the renewals: %d ok, %d failed", okN, failed)
	if failed != 0 || okN == 0 {
		t.Errorf("load across the renewals: %d ok, %d failed (first: %v), want none failed", okN, failed, first)
	}

	// The leaked operator certificate's resource is deleted: revoked, and
	// refused by every agent; the other operator keeps working.
	leaked := []string{"PVCLI_CA_FILE=" + filepath.Join(e.ca.dir, identity.ChainFile),
		"PVCLI_CERT_FILE=" + filepath.Join(e.ca.dir, "operator-leaked.crt"), "PVCLI_KEY_FILE=" + filepath.Join(e.ca.dir, "operator-leaked.key")}
	members := func(n *node, env []string) result {
		return c.pvcliEnv(t, env, "--endpoint", "https://"+n.api, "--timeout", "5s", "cluster", "members")
	}
	for _, n := range c.nodes {
		if r := members(n, leaked); r.code != 0 {
			t.Fatalf("operator-leaked before its deletion: %s", r)
		}
	}
	// Its files stay: the holder of a leaked copy keeps them.
	keep := t.TempDir()
	for _, f := range []string{"operator-leaked.crt", "operator-leaked.key"} {
		b, err := os.ReadFile(filepath.Join(e.ca.dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(keep, f), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	leaked[1] = "PVCLI_CERT_FILE=" + filepath.Join(keep, "operator-leaked.crt")
	leaked[2] = "PVCLI_KEY_FILE=" + filepath.Join(keep, "operator-leaked.key")
	if err := e.kc.Delete(ctx, e.mc(t, operatorNS, "operator-leaked")); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	c.eventually(t, revocationBound+15*time.Second, "every agent refuses the deleted resource's certificate", func() error {
		var still []string
		for _, n := range c.nodes {
			if r := members(n, leaked); r.code == 0 {
				still = append(still, n.name)
			}
		}
		if len(still) > 0 {
			return fmt.Errorf("still accepted by %s", strings.Join(still, ", "))
		}
		return nil
	})
	t.Logf("every agent refuses the deleted resource's certificate %s after its deletion", time.Since(start).Round(100*time.Millisecond))
	for _, n := range c.nodes {
		if r := members(n, c.operatorEnv()); r.code != 0 {
			t.Errorf("the operator certificate that was not deleted: %s", r)
		}
	}
}
