package gateway

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	hv1 "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"

	"pilab.hu/pivirt-agent/identity"
)

// peerHealth answers health checks, naming the caller's certificate CN in
// the service field's status: SERVING when the CN is "operator".
type peerHealth struct{ hv1.UnimplementedHealthServer }

func (peerHealth) Check(ctx context.Context, _ *hv1.HealthCheckRequest) (*hv1.HealthCheckResponse, error) {
	st := hv1.HealthCheckResponse_NOT_SERVING
	if p, ok := peer.FromContext(ctx); ok {
		if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 && ti.State.PeerCertificates[0].Subject.CommonName == "operator" {
			st = hv1.HealthCheckResponse_SERVING
		}
	}
	return &hv1.HealthCheckResponse{Status: st}, nil
}

// TestPeerTLSThroughTheMux: behind a TLS listener and the ProtocolMux,
// grpc-go (PeerTLSCredentials) and net/http (WithConnTLS) both see the
// client's certificate.
func TestPeerTLSThroughTheMux(t *testing.T) {
	dir := t.TempDir()
	if _, err := identity.InitCA(dir, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	srv, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindServer, Name: "api", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	op, err := identity.Issue(dir, identity.LeafRequest{Kind: identity.KindClient, Name: "operator"})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{CertFile: srv.Cert, KeyFile: srv.Key, CAFile: filepath.Join(dir, identity.ChainFile)})
	if err != nil {
		t.Fatal(err)
	}
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pm := NewProtocolMux(tls.NewListener(raw, src.ServerConfig(tls.RequireAndVerifyClientCert, nil)), 5*time.Second)
	gs := grpc.NewServer(grpc.Creds(PeerTLSCredentials{}))
	hv1.RegisterHealthServer(gs, peerHealth{})
	var protos http.Protocols
	protos.SetHTTP1(true)
	protos.SetUnencryptedHTTP2(true)
	hs := &http.Server{Protocols: &protos, ReadHeaderTimeout: 5 * time.Second, ConnContext: WithConnTLS,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if st, ok := ConnTLSFromContext(r.Context()); ok && len(st.PeerCertificates) > 0 {
				_, _ = io.WriteString(w, st.PeerCertificates[0].Subject.CommonName)
			}
		})}
	go func() { _ = gs.Serve(pm.GRPC) }()
	go func() { _ = hs.Serve(pm.HTTP) }()
	go func() { _ = pm.Serve() }()
	defer func() { gs.Stop(); _ = hs.Close(); _ = raw.Close() }()

	pair, err := tls.LoadX509KeyPair(op.Cert, op.Key)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	cas, err := identity.ReadCertificates(filepath.Join(dir, identity.ChainFile))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cas {
		roots.AddCert(c)
	}
	cfg := &tls.Config{RootCAs: roots, Certificates: []tls.Certificate{pair}, MinVersion: tls.VersionTLS12}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	conn, err := grpc.NewClient(raw.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	r, err := hv1.NewHealthClient(conn).Check(ctx, &hv1.HealthCheckRequest{})
	if err != nil || r.GetStatus() != hv1.HealthCheckResponse_SERVING {
		t.Errorf("gRPC handler did not see the client certificate: %v, %v", r, err)
	}

	tr := &http.Transport{TLSClientConfig: cfg, ForceAttemptHTTP2: true}
	defer tr.CloseIdleConnections()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "https://"+raw.Addr().String()+"/", nil)
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "operator" {
		t.Errorf("net/http handler saw %q, want the client certificate's CN operator", body)
	}
}
