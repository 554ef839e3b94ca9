// Package kubetest starts a real Kubernetes API server for the end-to-end
// tests of the operator: kube-apiserver (built from source by
// scripts/kube-apiserver.sh, from the version pinned in kubetest/apiserver)
// runs as a child process on 127.0.0.1, over a real etcd embedded in the
// test process (store/etcdstore/etcdtest), with RBAC authorization and
// static bearer tokens.
//
// Only the API server runs: there is no kube-controller-manager, scheduler
// or kubelet. Objects are stored, validated, defaulted, admitted and
// authorized as in a cluster, and watches behave as in a cluster, but
// nothing acts on them: a Deployment gets no ReplicaSet, a Pod is never
// scheduled, owner references do not cascade (no garbage collector), a
// deleted namespace stays Terminating (no namespace controller), and no
// ServiceAccount or token is created in a namespace. The ServiceAccount
// admission plugin is therefore off, so Pods and workloads can be created
// without a ServiceAccount object, and StorageObjectInUseProtection is off,
// so PersistentVolumeClaims and PersistentVolumes can be deleted (their
// protection finalizers would wait forever for kube-controller-manager).
//
// Tests that run with PIVIRT_KUBE_E2E=0 skip. PIVIRT_KUBE_APISERVER names a
// kube-apiserver binary to use instead of building one (an absolute path,
// or a command name looked up in PATH: go test runs a test in its
// package's directory).
package kubetest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"maps"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"pilab.hu/pivirt-agent/internal/freeport"
	"pilab.hu/pivirt-agent/store/etcdstore/etcdtest"
)

const (
	// modulePath is the module whose root holds scripts/kube-apiserver.sh.
	modulePath = "pilab.hu/pivirt-agent"

	readyTimeout = 90 * time.Second // kube-apiserver up to /readyz ok
	stopTimeout  = 20 * time.Second // SIGTERM to exit, then SIGKILL
	startTries   = 3                // when the picked port was taken meanwhile
)

// Server is a running kube-apiserver. It is stopped at the test's cleanup
// (SIGTERM, then SIGKILL after 20 s), before its etcd.
type Server struct {
	// Config is a client configuration for the admin (group
	// system:masters). Its client-side rate limit is off (QPS < 0).
	Config *rest.Config
	// URL is the server's address, https://127.0.0.1:<port>.
	URL string
	// AdminToken is the admin's bearer token.
	AdminToken string
	// Kubeconfig is the path of a kubeconfig file for the admin, for
	// kubectl and for child processes (--kubeconfig).
	Kubeconfig string
	// CAFile is the PEM file of the CA that signed the serving certificate;
	// CAData is its content.
	CAFile string
	CAData []byte
	// Etcd is the etcd cluster that stores the objects (one member).
	Etcd *etcdtest.Cluster
	// Dir is the server's temporary directory (certificates, token file,
	// kubeconfigs); LogFile is kube-apiserver's log, in Dir. The log's tail
	// is printed if the test fails.
	Dir, LogFile string

	tokens map[string]TokenUser // static tokens, the admin's included

	mu          sync.Mutex
	kubeconfigs map[string]string // token -> file
}

// TokenUser is the identity a static bearer token authenticates as. Every
// authenticated user is also in group system:authenticated.
type TokenUser struct {
	Name   string
	Groups []string
}

// Option configures Start.
type Option func(*options)

type options struct {
	tokens map[string]TokenUser
	args   []string
}

// WithToken makes token authenticate as user in groups. Such a user has no
// rights of its own: they come from the RBAC objects the test creates, so
// a process can run as the user its manifests describe (KubeconfigFor).
// The token and names may hold no comma, quote or line break.
func WithToken(token, user string, groups ...string) Option {
	return func(o *options) {
		o.tokens[token] = TokenUser{Name: user, Groups: groups}
	}
}

// WithArgs appends flags to kube-apiserver's command line, after Start's
// own (--secure-port excepted, which comes last). For a flag that takes one
// value, the last one given wins; a list flag given again adds to the list.
func WithArgs(args ...string) Option {
	return func(o *options) { o.args = append(o.args, args...) }
}

var (
	binaryMu   sync.Mutex
	binaryPath string // built (or found) once per test process
)

// APIServerBinary returns the path of a kube-apiserver binary:
// $PIVIRT_KUBE_APISERVER if set, else the one scripts/kube-apiserver.sh
// builds from source (or finds in its cache). It skips the test when
// PIVIRT_KUBE_E2E is "0", and fails it when no binary can be had.
func APIServerBinary(tb testing.TB) string {
	tb.Helper()
	if os.Getenv("PIVIRT_KUBE_E2E") == "0" {
		tb.Skip("PIVIRT_KUBE_E2E=0: not starting kube-apiserver")
	}
	if p := os.Getenv("PIVIRT_KUBE_APISERVER"); p != "" {
		// Absolute: the server runs in its temporary directory.
		p, err := exec.LookPath(p)
		if err == nil {
			p, err = filepath.Abs(p)
		}
		if err == nil {
			err = checkExecutable(p)
		}
		if err != nil {
			tb.Fatalf("PIVIRT_KUBE_APISERVER: %v", err)
		}
		return p
	}
	binaryMu.Lock()
	defer binaryMu.Unlock()
	if binaryPath != "" {
		return binaryPath
	}
	root, err := repoRoot()
	if err != nil {
		tb.Fatalf("kube-apiserver: %v", err)
	}
	script := filepath.Join(root, "scripts", "kube-apiserver.sh")
	cmd := exec.Command("bash", script)
	cmd.Dir = root
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	begin := time.Now()
	if err := cmd.Run(); err != nil {
		tb.Fatalf("%s: %v\n%s", script, err, tail(stderr.String(), 60))
	}
	if d := time.Since(begin); d > 5*time.Second {
		tb.Logf("built kube-apiserver in %v", d.Round(time.Second))
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	p := strings.TrimSpace(lines[len(lines)-1])
	if err := checkExecutable(p); err != nil {
		tb.Fatalf("%s printed %q: %v\n%s", script, stdout.String(), err, tail(stderr.String(), 60))
	}
	binaryPath = p
	return p
}

func checkExecutable(p string) error {
	fi, err := os.Stat(p)
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", p)
	}
	return nil
}

// repoRoot is the directory of the go.mod of module pilab.hu/pivirt-agent:
// the first one up from the working directory (a test's package
// directory), else up from this file's directory.
func repoRoot() (string, error) {
	var starts []string
	if wd, err := os.Getwd(); err == nil {
		starts = append(starts, wd)
	}
	if _, file, _, ok := runtime.Caller(0); ok && filepath.IsAbs(file) {
		starts = append(starts, filepath.Dir(file))
	}
	for _, dir := range starts {
		for range 64 { // bounded: a path has fewer components
			if moduleOf(filepath.Join(dir, "go.mod")) == modulePath {
				return dir, nil
			}
			parent := filepath.Dir(dir)
			if parent == dir {
				break
			}
			dir = parent
		}
	}
	return "", fmt.Errorf("no go.mod of module %s above %v", modulePath, starts)
}

// moduleOf is the module path a go.mod declares, "" if none.
func moduleOf(gomod string) string {
	b, err := os.ReadFile(gomod)
	if err != nil {
		return ""
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		line = strings.TrimSpace(line)
		if rest, ok := strings.CutPrefix(line, "module"); ok && (rest == "" || rest[0] == ' ' || rest[0] == '\t') {
			rest, _, _ = strings.Cut(rest, "//")
			return strings.Trim(strings.TrimSpace(rest), `"`+"`")
		}
	}
	return ""
}

// Start starts etcd and kube-apiserver and waits until the server is ready
// (/readyz) and the default namespace exists. It fails the test if that
// takes more than 90 s.
func Start(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	o := options{tokens: map[string]TokenUser{}}
	for _, opt := range opts {
		opt(&o)
	}
	for tok, u := range o.tokens {
		for _, f := range append([]string{tok, u.Name}, u.Groups...) {
			if f == "" || strings.ContainsAny(f, ",\"\r\n") {
				tb.Fatalf("kubetest: WithToken: tokens, user and group names must be non-empty, without commas, quotes or line breaks: %q", f)
			}
		}
	}
	bin := APIServerBinary(tb)

	// The temporary directory first: its removal then comes after the
	// process has stopped (cleanups run last-in first-out).
	dir := tb.TempDir()
	begin := time.Now()
	etcd := etcdtest.Start(tb, 1)
	etcdTook := time.Since(begin)

	s := &Server{
		Dir:         dir,
		Etcd:        etcd,
		AdminToken:  randomToken(tb),
		CAFile:      filepath.Join(dir, "ca.crt"),
		LogFile:     filepath.Join(dir, "kube-apiserver.log"),
		tokens:      map[string]TokenUser{},
		kubeconfigs: map[string]string{},
	}
	s.tokens[s.AdminToken] = TokenUser{Name: "admin", Groups: []string{"system:masters"}}
	maps.Copy(s.tokens, o.tokens)
	certFile, keyFile := s.writeCerts(tb)
	// The signing key (private) and the verifying key (public: the
	// verifier does not read PKCS #8 private keys).
	saKey := newKey(tb)
	saKeyFile := filepath.Join(dir, "service-account.key")
	writeFile(tb, saKeyFile, pemKey(tb, saKey))
	saPubFile := filepath.Join(dir, "service-account.pub")
	saPub, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		tb.Fatal(err)
	}
	writeFile(tb, saPubFile, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: saPub}))
	tokenFile := filepath.Join(dir, "tokens.csv")
	writeFile(tb, tokenFile, s.tokenCSV())

	args := []string{
		"--etcd-servers=" + strings.Join(etcd.Endpoints, ","),
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--cert-dir=" + filepath.Join(dir, "certs"),
		"--tls-cert-file=" + certFile,
		"--tls-private-key-file=" + keyFile,
		"--token-auth-file=" + tokenFile,
		"--anonymous-auth=false",
		"--authorization-mode=RBAC",
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + saPubFile,
		"--service-account-signing-key-file=" + saKeyFile,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--endpoint-reconciler-type=none",
		"--enable-priority-and-fairness=false",
		"--disable-admission-plugins=ServiceAccount,StorageObjectInUseProtection",
		"--allow-privileged=true",
		"--profiling=false",
	}
	args = append(args, o.args...)

	for try := 1; ; try++ {
		ports, err := freeport.Pick(1)
		if err != nil {
			tb.Fatalf("kube-apiserver port: %v", err)
		}
		s.URL = "https://127.0.0.1:" + strconv.Itoa(ports[0])
		p := s.startProcess(tb, bin, append(args, "--secure-port="+strconv.Itoa(ports[0])))
		err = s.waitReady(p)
		if err == nil {
			break
		}
		exited := p.exited()
		p.stop(tb)
		logTail := s.logTail(40)
		p.logShown = true // here, or not relevant: the next try overwrites the log
		if try < startTries && exited && strings.Contains(logTail, "address already in use") {
			tb.Logf("kube-apiserver: port %d was taken, trying another one", ports[0])
			continue
		}
		tb.Fatalf("kube-apiserver: %v\nlast lines of %s:\n%s", err, s.LogFile, logTail)
	}

	s.Config = s.ConfigFor(s.AdminToken)
	s.Kubeconfig = s.KubeconfigFor(s.AdminToken)
	tb.Logf("kube-apiserver ready at %s in %v (etcd: %v)", s.URL,
		time.Since(begin).Round(time.Millisecond), etcdTook.Round(time.Millisecond))
	return s
}

// ConfigFor returns a client configuration that authenticates with token
// (a static token of WithToken, or any other bearer token, such as a
// ServiceAccount's).
func (s *Server) ConfigFor(token string) *rest.Config {
	return &rest.Config{
		Host:            s.URL,
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: s.CAData},
		QPS:             -1, // no client-side throttling in tests
	}
}

// KubeconfigFor writes a kubeconfig file (in Dir) that authenticates with
// token, and returns its path; the same token gives the same file. The
// CA is embedded, the namespace is "default".
func (s *Server) KubeconfigFor(token string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if p, ok := s.kubeconfigs[token]; ok {
		return p
	}
	user := "user"
	if u, ok := s.tokens[token]; ok {
		user = u.Name
	}
	sum := sha256.Sum256([]byte(token))
	p := filepath.Join(s.Dir, "kubeconfig-"+hex.EncodeToString(sum[:6]))
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: s.URL, CertificateAuthorityData: s.CAData}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts[user] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: user, Namespace: "default"}
	cfg.CurrentContext = user
	if err := clientcmd.WriteToFile(*cfg, p); err != nil {
		// Only a full disk or a removed temporary directory gets here.
		panic(fmt.Sprintf("kubetest: write %s: %v", p, err))
	}
	s.kubeconfigs[token] = p
	return p
}

// process is a running kube-apiserver.
type process struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when it has exited; err is then set
	err  error
	once sync.Once
	// stopped is set by stop, before the process is told to exit;
	// logShown once the test has been given the log's tail.
	stopped, logShown bool
}

func (p *process) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// startProcess starts kube-apiserver with its output in LogFile (truncated)
// and registers its stop at cleanup.
func (s *Server) startProcess(tb testing.TB, bin string, args []string) *process {
	tb.Helper()
	logf, err := os.Create(s.LogFile)
	if err != nil {
		tb.Fatal(err)
	}
	defer logf.Close() // the child has its own descriptor
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Dir = s.Dir
	setParentDeathSignal(cmd)
	if err := cmd.Start(); err != nil {
		tb.Fatalf("start kube-apiserver: %v", err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	tb.Cleanup(func() {
		if p.exited() && !p.stopped {
			// It stopped during the test: it crashed, or was killed.
			tb.Logf("kube-apiserver had exited during the test: %v\nlast lines of %s:\n%s", p.err, s.LogFile, s.logTail(40))
			return
		}
		p.stop(tb)
		if tb.Failed() && !p.logShown {
			tb.Logf("last lines of %s:\n%s", s.LogFile, s.logTail(40))
		}
	})
	return p
}

// stop sends SIGTERM, and SIGKILL if the process has not exited 20 s
// later. It waits for the exit.
func (p *process) stop(tb testing.TB) {
	p.once.Do(func() {
		p.stopped = true
		if p.exited() {
			return
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		timer := time.NewTimer(stopTimeout)
		defer timer.Stop()
		select {
		case <-p.done:
			return
		case <-timer.C:
		}
		tb.Logf("kube-apiserver did not exit %v after SIGTERM: killing it", stopTimeout)
		_ = p.cmd.Process.Kill()
		timer.Reset(stopTimeout)
		select {
		case <-p.done:
		case <-timer.C:
			tb.Errorf("kube-apiserver (pid %d) did not exit after SIGKILL", p.cmd.Process.Pid)
		}
	})
}

// waitReady polls /readyz with the admin token until it answers ok, then
// the default namespace until it exists, for 90 s at most in all.
func (s *Server) waitReady(p *process) error {
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(s.CAData)
	client := &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}},
	}
	defer client.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), readyTimeout)
	defer cancel()
	ticker := time.NewTicker(100 * time.Millisecond)
	defer ticker.Stop()
	for _, path := range []string{"/readyz", "/api/v1/namespaces/default"} {
		var last string
		for {
			code, body, err := get(ctx, client, s.URL+path, s.AdminToken)
			if err == nil && code == http.StatusOK {
				break
			}
			if err != nil {
				last = err.Error()
			} else {
				last = fmt.Sprintf("%d %s", code, strings.TrimSpace(body))
			}
			select {
			case <-p.done:
				return fmt.Errorf("exited before it was ready (%v); last GET %s: %s", p.err, path, last)
			case <-ctx.Done():
				return fmt.Errorf("not ready after %v; last GET %s: %s", readyTimeout, path, last)
			case <-ticker.C:
			}
		}
	}
	return nil
}

func get(ctx context.Context, client *http.Client, url, token string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	return resp.StatusCode, string(body), err
}

// writeCerts writes a CA (CAFile) and a serving certificate it signs, for
// 127.0.0.1, localhost and the in-cluster names of the kubernetes Service.
func (s *Server) writeCerts(tb testing.TB) (certFile, keyFile string) {
	tb.Helper()
	now := time.Now()
	caKey := newKey(tb)
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(tb),
		Subject:               pkix.Name{CommonName: "kubetest CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(7 * 24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		tb.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		tb.Fatal(err)
	}
	key := newKey(tb)
	tmpl := &x509.Certificate{
		SerialNumber: serial(tb),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback, net.IPv4(10, 0, 0, 1)},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default",
			"kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, key.Public(), caKey)
	if err != nil {
		tb.Fatal(err)
	}
	s.CAData = pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER})
	writeFile(tb, s.CAFile, s.CAData)
	certFile = filepath.Join(s.Dir, "apiserver.crt")
	keyFile = filepath.Join(s.Dir, "apiserver.key")
	writeFile(tb, certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	writeFile(tb, keyFile, pemKey(tb, key))
	return certFile, keyFile
}

// tokenCSV is the --token-auth-file: token,user,uid,"group,group".
func (s *Server) tokenCSV() []byte {
	var b bytes.Buffer
	for tok, u := range s.tokens {
		fmt.Fprintf(&b, "%s,%s,%s", tok, u.Name, u.Name)
		if len(u.Groups) > 0 {
			fmt.Fprintf(&b, ",\"%s\"", strings.Join(u.Groups, ","))
		}
		b.WriteByte('\n')
	}
	return b.Bytes()
}

// logTail is the last n lines of the log.
func (s *Server) logTail(n int) string {
	b, err := os.ReadFile(s.LogFile)
	if err != nil {
		return err.Error()
	}
	return tail(string(b), n)
}

func tail(text string, n int) string {
	var lines []string
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
	}
	return strings.Join(lines[max(len(lines)-n, 0):], "\n")
}

func newKey(tb testing.TB) *ecdsa.PrivateKey {
	tb.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	return k
}

func pemKey(tb testing.TB, k *ecdsa.PrivateKey) []byte {
	tb.Helper()
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		tb.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
}

func serial(tb testing.TB) *big.Int {
	tb.Helper()
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		tb.Fatal(err)
	}
	return n
}

func randomToken(tb testing.TB) string {
	tb.Helper()
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		tb.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func writeFile(tb testing.TB, name string, data []byte) {
	tb.Helper()
	if err := os.WriteFile(name, data, 0o600); err != nil {
		tb.Fatal(err)
	}
}
