package agent_test

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/dynamicpb"

	"pilab.hu/pivirt-agent/cmd/internal/agent/agenttest"
	"pilab.hu/pivirt-agent/cmd/internal/config"
	"pilab.hu/pivirt-agent/gateway/mesh/schematest"
	"pilab.hu/pivirt-agent/identity"
)

// TestRoutedDescriptorSetAccess: a routed service the agent does not
// link, whose routing rule's descriptor set carries (pivirt.api.v1.authz)
// annotations, is guarded by them as the built-in APIs are: the policy
// names the annotations' resource (the file is accepted), a get is
// decided on the object the agent reads with the service's get method, a
// create on the object it carries, a list (gRPC and Connect JSON) is
// filtered; the method without an annotation stays the service's
// resource with the verb call.
func TestRoutedDescriptorSetAccess(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	file := schematest.File(t)
	backend := schematest.Register(gs, file, map[string]string{"a1": "alice", "b1": "bob"})
	served := make(chan struct{})
	go func() { _ = gs.Serve(ln); close(served) }()
	t.Cleanup(func() { gs.Stop(); <-served })

	set := schematest.WriteSet(t)
	policy := filepath.Join(t.TempDir(), "widgets-rbac.yaml")
	if err := os.WriteFile(policy, []byte(schematest.Policy), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newAccessEnvWith(t, 1, func(_ int, cfg *config.Config) {
		cfg.Backends = map[string]config.BackendConfig{"widgets": {Endpoint: ln.Addr().String(), Scope: config.ScopeCluster}}
		cfg.Routing.Rules = []config.RouteRule{
			{Match: config.RouteMatch{Prefix: "/" + schematest.Service}, Route: config.RouteTarget{Cluster: "widgets", DescriptorSet: set}},
		}
	}, func(cfg *config.Config) { cfg.Auth.RBACPolicy = policy })

	sd := file.Services().ByName("WidgetService")
	call := func(token, method string, fill func(m protoreflect.Message)) (protoreflect.Message, error) {
		md := sd.Methods().ByName(protoreflect.Name(method))
		req, resp := dynamicpb.NewMessage(md.Input()), dynamicpb.NewMessage(md.Output())
		if fill != nil {
			fill(req)
		}
		err := e.conn.Invoke(as(e.ctx(), token), "/"+schematest.Service+"/"+method, req, resp)
		return resp, err
	}
	setID := func(id string) func(m protoreflect.Message) {
		return func(m protoreflect.Message) {
			m.Set(m.Descriptor().Fields().ByName("id"), protoreflect.ValueOfString(id))
		}
	}
	newWidget := func(id, owner string) func(m protoreflect.Message) {
		return func(m protoreflect.Message) {
			w := m.Mutable(m.Descriptor().Fields().ByName("widget")).Message()
			w.Set(w.Descriptor().Fields().ByName("id"), protoreflect.ValueOfString(id))
			meta := w.Mutable(w.Descriptor().Fields().ByName("metadata")).Message()
			meta.Set(meta.Descriptor().Fields().ByName("owner"), protoreflect.ValueOfString(owner))
		}
	}
	ids := func(resp protoreflect.Message) []string {
		var out []string
		l := resp.Get(resp.Descriptor().Fields().ByName("widgets")).List()
		for i := range l.Len() {
			w := l.Get(i).Message()
			out = append(out, w.Get(w.Descriptor().Fields().ByName("id")).String())
		}
		return out
	}
	alice, pinger, admin := e.token("alice", "widget-owner"), e.token("pete", "pinger"), e.token("root", "admin")

	// The route's first calls may wait for the backend's endpoint.
	agenttest.Eventually(t, 10*time.Second, "the widget service through the agent", func() error {
		_, err := call(admin, "Ping", nil)
		return err
	})

	for _, tc := range []struct {
		name, token, method string
		fill                func(m protoreflect.Message)
		want                codes.Code
		msg                 string
	}{
		{"her widget", alice, "GetWidget", setID("a1"), codes.OK, ""},
		{"bob's widget", alice, "GetWidget", setID("b1"), codes.PermissionDenied, "may not get widgets b1"},
		{"a widget that does not exist", alice, "GetWidget", setID("nope"), codes.PermissionDenied, "may not get widgets nope"},
		{"a create of hers", alice, "CreateWidget", newWidget("a2", "alice"), codes.OK, ""},
		{"a create for bob", alice, "CreateWidget", newWidget("b2", "bob"), codes.PermissionDenied, "may not create widgets"},
		{"the service's call rule does not grant the annotated methods", pinger, "GetWidget", setID("a1"), codes.PermissionDenied, "may not get widgets"},
		{"the unannotated method: call on the service", pinger, "Ping", nil, codes.OK, ""},
		{"the unannotated method without a rule on the service", alice, "Ping", nil, codes.PermissionDenied, "may not call acme.widget.v1.WidgetService"},
	} {
		_, err := call(tc.token, tc.method, tc.fill)
		if status.Code(err) != tc.want || !strings.Contains(status.Convert(err).Message(), tc.msg) {
			t.Errorf("%s: %v, want %s %q", tc.name, err, tc.want, tc.msg)
		}
	}
	// The backend saw the allowed create only.
	creates := 0
	for _, c := range backend.Calls() {
		if c == "CreateWidget" {
			creates++
		}
	}
	if creates != 1 {
		t.Errorf("the backend was asked to create %d widgets, want 1 (the refused create reached it): %v", creates, backend.Calls())
	}

	// A list is filtered for her, not for admin.
	resp, err := call(alice, "ListWidgets", nil)
	if got := ids(resp); err != nil || !slices.Equal(got, []string{"a1", "a2"}) {
		t.Errorf("alice's list: %v %v, want [a1 a2]", got, err)
	}
	resp, err = call(admin, "ListWidgets", nil)
	if got := ids(resp); err != nil || !slices.Equal(got, []string{"a1", "a2", "b1"}) {
		t.Errorf("admin's list: %v %v, want [a1 a2 b1]", got, err)
	}

	// Connect with JSON: transcoded by the schema, then filtered the same.
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{
		RootCAs: mustPool(t, filepath.Join(e.dir, identity.ChainFile)), MinVersion: tls.VersionTLS12,
	}}}
	t.Cleanup(hc.CloseIdleConnections)
	hreq, err := http.NewRequestWithContext(e.ctx(), http.MethodPost, "https://"+e.n.APIAddr()+"/"+schematest.Service+"/ListWidgets", bytes.NewReader([]byte("{}")))
	if err != nil {
		t.Fatal(err)
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("Authorization", "Bearer "+alice)
	hresp, err := hc.Do(hreq)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(hresp.Body)
	hresp.Body.Close()
	var list struct {
		Widgets []struct {
			ID string `json:"id"`
		} `json:"widgets"`
	}
	if err := json.Unmarshal(body, &list); err != nil || hresp.StatusCode != http.StatusOK || len(list.Widgets) != 2 || list.Widgets[0].ID != "a1" || list.Widgets[1].ID != "a2" {
		t.Errorf("alice's list over Connect JSON: %d %s (%v)", hresp.StatusCode, body, err)
	}

	// A reload whose rule names no descriptor set: the service is a
	// resource of its name again (verb call); one naming it again: the
	// annotations again.
	reload := func(descriptorSet string) {
		t.Helper()
		next := *e.n.Cfg
		next.Routing.Rules = []config.RouteRule{
			{Match: config.RouteMatch{Prefix: "/" + schematest.Service}, Route: config.RouteTarget{Cluster: "widgets", DescriptorSet: descriptorSet}},
		}
		if _, _, err := e.n.ReloadConfig(&next); err != nil {
			t.Fatal(err)
		}
	}
	reload("")
	if _, err := call(alice, "GetWidget", setID("a1")); status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "may not call acme.widget.v1.WidgetService") {
		t.Errorf("alice's GetWidget without the descriptor set: %v, want PermissionDenied (call on the service)", err)
	}
	if _, err := call(pinger, "GetWidget", setID("b1")); err != nil {
		t.Errorf("the service's caller's GetWidget without the descriptor set: %v", err)
	}
	reload(schematest.WriteSet(t))
	if _, err := call(alice, "GetWidget", setID("a1")); err != nil {
		t.Errorf("alice's GetWidget with the descriptor set again: %v", err)
	}
	if _, err := call(pinger, "GetWidget", setID("b1")); status.Code(err) != codes.PermissionDenied {
		t.Errorf("the service's caller's GetWidget with the descriptor set again: %v, want PermissionDenied", err)
	}
}

// TestRoutedDescriptorSetPlacement: a node-scoped backend of a routed
// service whose descriptor set carries the annotations is routed by
// object as the built-in APIs are, with the same access control: a
// widget-owner reaches her widget on the other node through either node
// (its object read and checked where it lives), not bob's, and her list
// through either node holds her widgets of both nodes only.
func TestRoutedDescriptorSetPlacement(t *testing.T) {
	file := schematest.File(t)
	owners := []map[string]string{{"a1": "alice", "b1": "bob"}, {"c1": "alice", "d1": "bob"}}
	addrs := make([]string, len(owners))
	for i, o := range owners {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		gs := grpc.NewServer()
		schematest.Register(gs, file, o)
		served := make(chan struct{})
		go func() { _ = gs.Serve(ln); close(served) }()
		t.Cleanup(func() { gs.Stop(); <-served })
		addrs[i] = ln.Addr().String()
	}
	set := schematest.WriteSet(t)
	policy := filepath.Join(t.TempDir(), "widgets-rbac.yaml")
	if err := os.WriteFile(policy, []byte(schematest.Policy), 0o600); err != nil {
		t.Fatal(err)
	}
	e := newAccessEnvWith(t, 2, func(i int, cfg *config.Config) {
		cfg.Backends = map[string]config.BackendConfig{"widgets": {Endpoint: addrs[i], Scope: config.ScopeNode, Timeout: config.Duration(10 * time.Second)}}
		cfg.Routing.Rules = []config.RouteRule{
			{Match: config.RouteMatch{Prefix: "/" + schematest.Service}, Route: config.RouteTarget{Cluster: "widgets", DescriptorSet: set}},
		}
	}, func(cfg *config.Config) { cfg.Auth.RBACPolicy = policy })
	e.c.WaitPeers(30*time.Second, 2, 0)

	sd := file.Services().ByName("WidgetService")
	alice := e.token("alice", "widget-owner")
	for _, n := range e.c.Nodes() {
		conn := e.dialAt(n.APIAddr(), nil)
		call := func(method, id string) (protoreflect.Message, error) {
			md := sd.Methods().ByName(protoreflect.Name(method))
			req, resp := dynamicpb.NewMessage(md.Input()), dynamicpb.NewMessage(md.Output())
			if id != "" {
				req.Set(md.Input().Fields().ByName("id"), protoreflect.ValueOfString(id))
			}
			return resp, conn.Invoke(as(e.ctx(), alice), "/"+schematest.Service+"/"+method, req, resp)
		}
		agenttest.Eventually(t, 20*time.Second, "alice's widgets through "+n.Name, func() error {
			for _, id := range []string{"a1", "c1"} {
				resp, err := call("GetWidget", id)
				if err != nil {
					return fmt.Errorf("GetWidget %s: %w", id, err)
				}
				w := resp.Get(resp.Descriptor().Fields().ByName("widget")).Message()
				if got := w.Get(w.Descriptor().Fields().ByName("id")).String(); got != id {
					return fmt.Errorf("GetWidget %s answered %s", id, got)
				}
			}
			return nil
		})
		for _, id := range []string{"b1", "d1"} {
			if _, err := call("GetWidget", id); status.Code(err) != codes.PermissionDenied {
				t.Errorf("alice reads bob's widget %s through %s: %v, want PermissionDenied", id, n.Name, err)
			}
		}
		resp, err := call("ListWidgets", "")
		if err != nil {
			t.Fatalf("alice's list through %s: %v", n.Name, err)
		}
		var got []string
		l := resp.Get(resp.Descriptor().Fields().ByName("widgets")).List()
		for i := range l.Len() {
			w := l.Get(i).Message()
			got = append(got, w.Get(w.Descriptor().Fields().ByName("id")).String())
		}
		if !slices.Equal(got, []string{"a1", "c1"}) {
			t.Errorf("alice's list through %s: %v, want [a1 c1] (both nodes', hers only)", n.Name, got)
		}
	}
}
