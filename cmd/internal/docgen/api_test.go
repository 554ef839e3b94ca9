package docgen

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"

	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// TestAPIReferenceFromProtos: a section's services, their methods with
// the RBAC of their annotations, the types they reach with the comments
// of the .proto files, and the packages left out with their package
// comment's first sentence.
func TestAPIReferenceFromProtos(t *testing.T) {
	page, err := APIReference(filepath.Join("..", "..", "..", "proto"), APISection{
		Title: "VMs", Intro: "The VM API.",
		Services: []protoreflect.ServiceDescriptor{vmv1.File_pivirt_vm_v1_vm_proto.Services().ByName("VMService")},
		RBAC:     true,
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"- [VMs](#vms): [VMService](#pivirtvmv1vmservice)\n",
		"| [UpdateVM](#vmserviceupdatevm) | [`UpdateVMRequest`](#pivirtvmv1updatevmrequest) | [`UpdateVMResponse`](#pivirtvmv1updatevmresponse) | unary | `virtualmachines` `update` |\n",
		"#### `VMService.UpdateVM`\n\nUpdateVM changes the fields of update_mask",
		"#### `pivirt.api.v1.ObjectMeta`\n", // reached through VM.metadata
		"`google.protobuf.Timestamp`",
		"- `pivirt.sim.v1` (`SimulatorService`): Package pivirt.sim.v1 is the control API of pivirtd-sim",
	} {
		if !strings.Contains(string(page), want) {
			t.Errorf("the page lacks %q", want)
		}
	}
	if strings.Contains(string(page), "pivirt.schedule.v1.Schedule`\n") {
		t.Error("the page describes a type no documented method reaches")
	}
}

// TestAPIReferenceStaleGeneratedCode: a service whose .proto file and
// generated code have different methods is an error that says to run
// make generate.
func TestAPIReferenceStaleGeneratedCode(t *testing.T) {
	dir := t.TempDir()
	proto := `syntax = "proto3";
package pivirt.sim.v1;
service SimulatorService {
  rpc Stats(StatsRequest) returns (StatsResponse) {}
}
message StatsRequest {}
message StatsResponse {}
`
	if err := os.MkdirAll(filepath.Join(dir, "sim"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "sim", "sim.proto"), []byte(proto), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := APIReference(dir, APISection{Title: "Sim", Services: []protoreflect.ServiceDescriptor{simv1.File_pivirt_sim_v1_sim_proto.Services().ByName("SimulatorService")}})
	if err == nil || !strings.Contains(err.Error(), "make generate") {
		t.Fatalf("APIReference: %v, want an error saying to run make generate", err)
	}
}

// TestGithubAnchor: the anchors of the page's headings are GitHub's.
func TestGithubAnchor(t *testing.T) {
	for heading, want := range map[string]string{
		"`pivirt.vm.v1.VMService`":   "pivirtvmv1vmservice",
		"`VMService.GetVM`":          "vmservicegetvm",
		"Messages and enums":         "messages-and-enums",
		"PiTrust CA server (8443)":   "pitrust-ca-server-8443",
		"`pivirt.api.v1.ObjectMeta`": "pivirtapiv1objectmeta",
	} {
		if got := githubAnchor(heading); got != want {
			t.Errorf("githubAnchor(%q) = %q, want %q", heading, got, want)
		}
	}
}
