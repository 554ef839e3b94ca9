package agent_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/identity"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
)

// probeAgent starts one agent with TLS on and client certificates
// optional (tls.require_client_cert false, the default of withTLS).
func probeAgent(t *testing.T) (*agenttest.Cluster, *agenttest.Node, string) {
	t.Helper()
	dir := testPKI(t, 1)
	c := agenttest.NewExpect(t, 1, func(i int, cfg *config.Config) {
		withTLS(dir)(i, cfg)
		if cfg.TLS.RequireClientCert {
			t.Fatal("withTLS requires client certificates; this test needs them optional")
		}
	})
	return c, c.WaitLeader(waitFor), dir
}

// TestHealthAndReflectionWithoutCredentials: with client certificates
// optional, what grpcurl and grpc-health-probe need — the health check and
// both versions of server reflection — answer a client with neither a
// certificate nor a token; every other method still refuses it. Every
// service of the agent's own has a health status.
func TestHealthAndReflectionWithoutCredentials(t *testing.T) {
	_, n, dir := probeAgent(t)
	cfg := &tls.Config{RootCAs: mustPool(t, filepath.Join(dir, identity.ChainFile)), MinVersion: tls.VersionTLS12}
	conn, err := grpc.NewClient(n.APIAddr(), grpc.WithTransportCredentials(credentials.NewTLS(cfg)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()

	h := healthpb.NewHealthClient(conn)
	for _, svc := range []string{"", clusterv1.ClusterService_ServiceDesc.ServiceName, clusterv1.SnapshotService_ServiceDesc.ServiceName, schedulev1.ScheduleService_ServiceDesc.ServiceName} {
		agenttest.Eventually(t, 10*time.Second, fmt.Sprintf("health of %q SERVING without credentials", svc), func() error {
			r, err := h.Check(ctx, &healthpb.HealthCheckRequest{Service: svc})
			if err != nil || r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
				return fmt.Errorf("%v %v, want SERVING", r, err)
			}
			return nil
		})
	}

	stream, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := stream.Recv()
	if err != nil {
		t.Fatalf("reflection v1 without credentials: %v", err)
	}
	var services []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		services = append(services, s.GetName())
	}
	for _, want := range []string{"grpc.health.v1.Health", clusterv1.ClusterService_ServiceDesc.ServiceName, schedulev1.ScheduleService_ServiceDesc.ServiceName} {
		if !slices.Contains(services, want) {
			t.Errorf("reflection lists %v, without %s", services, want)
		}
	}
	// What grpcurl asks next: the file of a service.
	if err := stream.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_FileContainingSymbol{FileContainingSymbol: "grpc.health.v1.Health"}}); err != nil {
		t.Fatal(err)
	}
	if resp, err := stream.Recv(); err != nil || len(resp.GetFileDescriptorResponse().GetFileDescriptorProto()) == 0 {
		t.Errorf("reflection v1 file of grpc.health.v1.Health without credentials: %v %v", resp.GetErrorResponse(), err)
	}
	_ = stream.CloseSend()
	if got, err := listServicesV1alpha(ctx, conn); err != nil || !slices.Contains(got, "grpc.health.v1.Health") {
		t.Errorf("reflection v1alpha without credentials: %v %v", got, err)
	}

	// Nothing else opened.
	if _, err := clusterv1.NewClusterServiceClient(conn).Leader(ctx, &clusterv1.LeaderRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("ClusterService/Leader without credentials: %v, want Unauthenticated", err)
	}
	if _, err := schedulev1.NewScheduleServiceClient(conn).ListSchedules(ctx, &schedulev1.ListSchedulesRequest{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("ScheduleService/ListSchedules without credentials: %v, want Unauthenticated", err)
	}
	// grpc-go hands an unknown method of a known service to the proxy: a
	// name under an open service is not open.
	if err := conn.Invoke(ctx, "/grpc.health.v1.Health/Other", &healthpb.HealthCheckRequest{}, &healthpb.HealthCheckResponse{}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("an unknown method of grpc.health.v1.Health without credentials: %v, want Unauthenticated", err)
	}
}

// TestPlaintextOnTLSPort: a client that speaks plaintext to the TLS API
// port — HTTP/1 (curl http://), HTTP/2 with prior knowledge as a gRPC
// client without TLS (grpcurl -plaintext), or a Connect client over h2c
// — gets an answer saying the port speaks TLS, promptly, and the agent
// logs the client's address.
func TestPlaintextOnTLSPort(t *testing.T) {
	c, n, _ := probeAgent(t)
	addr := n.APIAddr()
	local := func(conn net.Conn) string { return conn.LocalAddr().String() }

	t.Run("HTTP/1", func(t *testing.T) {
		conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.WriteString(conn, "GET /pivirt.cluster.v1.ClusterService/Leader HTTP/1.1\r\nHost: "+addr+"\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("no HTTP answer within 5s: %v", err)
		}
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "speaks TLS") {
			t.Errorf("answer %s %q, want 400 saying the port speaks TLS", resp.Status, body)
		}
		waitLog(t, c, local(conn))
	})

	t.Run("gRPC over h2c", func(t *testing.T) {
		var from string
		conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
				c, err := (&net.Dialer{}).DialContext(ctx, "tcp", a)
				if err == nil {
					from = local(c)
				}
				return c, err
			}))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		_, err = healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "speaks TLS") {
			t.Fatalf("health check over h2c: %v, want Unavailable saying the port speaks TLS", err)
		}
		waitLog(t, c, from)
	})

	t.Run("HTTP/2 without TLS, not gRPC", func(t *testing.T) {
		hc := agenttest.NewHTTPClient()
		defer hc.CloseIdleConnections()
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/pivirt.cluster.v1.ClusterService/Leader", strings.NewReader("{}"))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatalf("no answer within 5s: %v", err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "speaks TLS") {
			t.Errorf("answer %s %q, want 400 saying the port speaks TLS", resp.Status, body)
		}
	})
}

// waitLog waits for the agent's line about a plaintext client from addr.
func waitLog(t *testing.T, c *agenttest.Cluster, addr string) {
	t.Helper()
	agenttest.Eventually(t, 5*time.Second, "the log line naming the plaintext client "+addr, func() error {
		for _, line := range strings.Split(c.Logs().Tail(200), "\n") {
			if strings.Contains(line, "spoke plaintext to the TLS port") && strings.Contains(line, addr) {
				return nil
			}
		}
		return fmt.Errorf("no line")
	})
}
