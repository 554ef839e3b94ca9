package main

import (
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"pilab.hu/pivirt-agent/cmd/internal/caserver"
	"pilab.hu/pivirt-agent/identity"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

func TestUsageErrors(t *testing.T) {
	dir := t.TempDir()
	for want, args := range map[string][]string{
		"--listen: required":    {"--data-dir", dir},
		"--data-dir: required":  {"--listen", "127.0.0.1:0"},
		"go together":           {"--listen", "127.0.0.1:0", "--data-dir", dir, "--tls-cert-file", "x"},
		"--fail-percent: 101":   {"--listen", "127.0.0.1:0", "--data-dir", dir, "--fail-percent", "101"},
		"--fail-code: 0":        {"--listen", "127.0.0.1:0", "--data-dir", dir, "--fail-code", "0"},
		"--log-format: \"xml\"": {"--listen", "127.0.0.1:0", "--data-dir", dir, "--log-format", "xml"},
		"unknown flag":          {"--nope"},
		"--ca-server renews":    {"--listen", "127.0.0.1:0", "--data-dir", dir, "--ca-server", "https://127.0.0.1:1"},
		"unknown command":       {"extra"},
	} {
		err := Run(t.Context(), args, &bytes.Buffer{}, &bytes.Buffer{})
		var ue *usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), want) {
			t.Errorf("Run(%v) = %v, want a usage error containing %q", args, err, want)
		}
	}
}

// syncBuffer is a bytes.Buffer safe for the server's log writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestServeMutualTLS runs the command with TLS: a client with a
// certificate of the chain is served, one without is refused.
func TestServeMutualTLS(t *testing.T) {
	pki := t.TempDir()
	if _, err := identity.InitCA(pki, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	srv, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindServer, Name: "pivirtd.pivirt.internal", IPs: []net.IP{net.IPv4(127, 0, 0, 1)}})
	if err != nil {
		t.Fatal(err)
	}
	cli, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node1"})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()

	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	var out syncBuffer
	go func() {
		done <- Run(ctx, []string{"--listen", addr, "--data-dir", t.TempDir(), "--role", "pivirtd",
			"--tls-cert-file", srv.Cert, "--tls-key-file", srv.Key, "--tls-ca-file", filepath.Join(pki, identity.ChainFile)}, &out, &out)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		if !strings.Contains(out.String(), "pivirtd-sim stopped") {
			t.Errorf("no stop logged:\n%s", out.String())
		}
	}()

	src, err := identity.NewSource(identity.SourceConfig{CertFile: cli.Cert, KeyFile: cli.Key, CAFile: filepath.Join(pki, identity.ChainFile)})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(src.ClientConfig("127.0.0.1"))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		_, err = vmv1.NewVMServiceClient(conn).ListVMs(cctx, &vmv1.ListVMsRequest{})
		ccancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("ListVMs over mTLS: %v\n%s", err, out.String())
		}
		time.Sleep(100 * time.Millisecond)
	}

	noCert, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
		RootCAs: src.ClientConfig("127.0.0.1").RootCAs, InsecureSkipVerify: true, MinVersion: tls.VersionTLS12, //nolint:gosec // the server is not what this checks
	})))
	if err != nil {
		t.Fatal(err)
	}
	defer noCert.Close()
	cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
	defer ccancel()
	if _, err := vmv1.NewVMServiceClient(noCert).ListVMs(cctx, &vmv1.ListVMsRequest{}); err == nil {
		t.Error("a client without a certificate was served")
	}
	plain, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if _, err := vmv1.NewVMServiceClient(plain).ListVMs(cctx, &vmv1.ListVMsRequest{}); err == nil {
		t.Error("a plaintext client was served")
	}
}

// TestRenewsThroughCAServer: a simulator whose certificate lives 30 s
// renews it through a PiTrust CA server a third of its lifetime before
// expiry and serves the new one, while calls on an open connection go on
// without a failure.
func TestRenewsThroughCAServer(t *testing.T) {
	pki := t.TempDir()
	if _, err := identity.InitCA(pki, identity.CAOptions{}); err != nil {
		t.Fatal(err)
	}
	srv, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindServer, Name: "pivirtd.pivirt.internal",
		IPs: []net.IP{net.IPv4(127, 0, 0, 1)}, Validity: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	cli, err := identity.Issue(pki, identity.LeafRequest{Kind: identity.KindClient, Name: "pivirt-agent-node1"})
	if err != nil {
		t.Fatal(err)
	}
	cfg := caserver.Default()
	cfg.Server.Addr, cfg.Server.CertsDir, cfg.Server.DBPath = "127.0.0.1:0", pki, filepath.Join(t.TempDir(), "certs.db")
	ca, err := caserver.New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	caDone := make(chan error, 1)
	go func() { caDone <- ca.Serve(ctx) }()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	done := make(chan error, 1)
	var out syncBuffer
	chain := filepath.Join(pki, identity.ChainFile)
	go func() {
		done <- Run(ctx, []string{"--listen", addr, "--data-dir", t.TempDir(), "--role", "pivirtd",
			"--tls-cert-file", srv.Cert, "--tls-key-file", srv.Key, "--tls-ca-file", chain,
			"--ca-server", "https://" + ca.Addr().String()}, &out, &out)
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
		<-caDone
	}()

	src, err := identity.NewSource(identity.SourceConfig{CertFile: cli.Cert, KeyFile: cli.Key, CAFile: chain})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(credentials.NewTLS(src.ClientConfig("127.0.0.1"))))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	first, err := identity.ReadCertificates(srv.Cert)
	if err != nil {
		t.Fatal(err)
	}
	var (
		calls, failed int
		served        bool // a call succeeded: the simulator is up
		firstErr      error
	)
	deadline := time.Now().Add(60 * time.Second)
	for {
		cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
		_, err := vmv1.NewVMServiceClient(conn).ListVMs(cctx, &vmv1.ListVMsRequest{})
		ccancel()
		switch {
		case err == nil:
			calls, served = calls+1, true
		case served:
			calls, failed = calls+1, failed+1
			firstErr = cmp.Or(firstErr, err)
		}
		serving := servedSerial(t, addr, src)
		if serving != "" && serving != first[0].SerialNumber.String() {
			now, err := identity.ReadCertificates(srv.Cert)
			if err != nil {
				t.Fatal(err)
			}
			if now[0].SerialNumber.String() != serving {
				t.Fatalf("serves %s, the file holds %s", serving, now[0].SerialNumber)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("certificate %s not renewed within 60s:\n%s", first[0].SerialNumber, out.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
	if failed > 0 {
		t.Errorf("%d of %d calls failed during the renewal; first: %v", failed, calls, firstErr)
	}
	if !strings.Contains(out.String(), "certificate renewal scheduled") {
		t.Errorf("no renewal logged:\n%s", out.String())
	}
}

// servedSerial is the serial of the certificate the server at addr serves
// to a new connection ("" when it cannot be reached yet).
func servedSerial(t *testing.T, addr string, src *identity.Source) string {
	t.Helper()
	c, err := tls.Dial("tcp", addr, src.ClientConfig("127.0.0.1"))
	if err != nil {
		return ""
	}
	defer c.Close()
	return c.ConnectionState().PeerCertificates[0].SerialNumber.String()
}
