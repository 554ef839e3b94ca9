package mesh

import (
	"errors"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

func TestPageTokens(t *testing.T) {
	for _, id := range []string{"vm-1", "a/b c", "ünïcode"} {
		got, err := decodePageToken(encodePageToken(id))
		if err != nil || got.after != id {
			t.Errorf("round trip of %q: %q, %v", id, got.after, err)
		}
	}
	if got, err := decodePageToken(""); err != nil || got.after != "" {
		t.Errorf("empty token: %q, %v", got.after, err)
	}
	for _, tok := range []string{"garbage!", "dm0tMQ", encodePageToken("")} {
		_, err := decodePageToken(tok)
		if st := status.Convert(err); st.Code() != codes.InvalidArgument || !strings.Contains(st.Message(), "page_token") {
			t.Errorf("token %q: %v, want InvalidArgument naming page_token", tok, err)
		}
	}
}

func TestFieldPaths(t *testing.T) {
	req := (&vmv1.CreateVMRequest{Vm: &vmv1.VM{Host: "node2", Name: "x"}}).ProtoReflect()
	if got := stringAt(req, "vm.host"); got != "node2" {
		t.Errorf("vm.host = %q", got)
	}
	for _, path := range []string{"host", "vm.vcpus", "vm.metadata.owner", "nope", "vm.nope.x"} {
		if got := stringAt(req, path); got != "" {
			t.Errorf("%s = %q, want empty", path, got)
		}
	}
	if got := lookupMethod("/pivirt.vm.v1.VMService/UpdateVM"); stringAt((&vmv1.UpdateVMRequest{Vm: &vmv1.VM{Id: "vm-1"}}).ProtoReflect(), got.rule.GetIdField()) != "vm-1" {
		t.Errorf("the id_field of UpdateVM (%q) does not read the VM's ID", got.rule.GetIdField())
	}
}

func TestUnavailableNodeIsAHeaderValue(t *testing.T) {
	long := strings.Repeat("x", 1000)
	cases := []struct {
		name, node string
		err        error
		want       string
	}{
		{"plain", "node2", status.Error(codes.Unavailable, "node node2 is unreachable"), "node2: node node2 is unreachable"},
		{"newlines and tabs", "node2", status.Error(codes.Unimplemented, "unexpected HTTP status code received from server: 404 (Not Found);\n\ttransport: received unexpected content-type"),
			"node2: unexpected HTTP status code received from server: 404 (Not Found); transport: received unexpected content-type"},
		{"not ASCII", "nöde", errors.New("bad\x00byte"), "n?de: bad?byte"},
		{"long", "node2", errors.New(long), "node2: " + long[:maxUnavailableReason-len("node2: ")-3] + "..."},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := unavailableNode(tc.node, tc.err)
			if got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
			for i := range len(got) {
				if got[i] < 0x20 || got[i] > 0x7e {
					t.Fatalf("byte %d of %q is not printable ASCII", i, got)
				}
			}
		})
	}
}
