package authz

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	apiv1 "pilab.hu/pivirt-agent/proto/pivirt/api/v1"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	networkv1 "pilab.hu/pivirt-agent/proto/pivirt/network/v1"
	schedulev1 "pilab.hu/pivirt-agent/proto/pivirt/schedule/v1"
	simv1 "pilab.hu/pivirt-agent/proto/pivirt/sim/v1"
	storagev1 "pilab.hu/pivirt-agent/proto/pivirt/storage/v1"
	vmv1 "pilab.hu/pivirt-agent/proto/pivirt/vm/v1"
)

// apiPort lists every service the agent's API port serves (grpc.health.v1
// and reflection aside, which carry no resource).
var apiPort = []protoreflect.ServiceDescriptor{
	clusterv1.File_pivirt_cluster_v1_cluster_proto.Services().ByName("ClusterService"),
	clusterv1.File_pivirt_cluster_v1_snapshot_proto.Services().ByName("SnapshotService"),
	schedulev1.File_pivirt_schedule_v1_service_proto.Services().ByName("ScheduleService"),
	clusterv1.File_pivirt_cluster_v1_agent_proto.Services().ByName("AgentService"),
	vmv1.File_pivirt_vm_v1_vm_proto.Services().ByName("VMService"),
	storagev1.File_pivirt_storage_v1_storage_proto.Services().ByName("StorageService"),
	networkv1.File_pivirt_network_v1_network_proto.Services().ByName("NetworkService"),
}

// TestEveryMethodAnnotated enumerates every method of the API port and
// checks its authorization annotation.
func TestEveryMethodAnnotated(t *testing.T) {
	n := 0
	for _, sd := range apiPort {
		for i := range sd.Methods().Len() {
			md := sd.Methods().Get(i)
			if _, err := MethodRule(md); err != nil {
				t.Error(err)
			}
			n++
		}
	}
	if n < 40 {
		t.Errorf("only %d methods enumerated", n)
	}
	want := []string{"agent", "cluster", "config", "keyring", "networks", "rbac", "schedules", "services", "snapshots", "virtualmachines", "volumes"}
	if got := Resources(apiPort...); len(got) != len(want) {
		t.Errorf("Resources = %v, want %v", got, want)
	}
}

// TestMethodRuleRefuses: a method without an annotation (the simulator's
// control API has none) is refused; field paths are checked.
func TestMethodRuleRefuses(t *testing.T) {
	md := simv1.File_pivirt_sim_v1_sim_proto.Services().ByName("SimulatorService").Methods().ByName("SetFault")
	if _, err := MethodRule(md); !errors.Is(err, ErrNoAnnotation) || !strings.Contains(err.Error(), "pivirt.sim.v1.SimulatorService.SetFault") {
		t.Errorf("MethodRule of an unannotated method = %v, want ErrNoAnnotation naming it", err)
	}
	req := vmv1.File_pivirt_vm_v1_vm_proto.Messages().ByName("UpdateVMRequest")
	if !hasPath(req, "vm.id") || !hasPath(req, "vm.metadata.owner") || hasPath(req, "vm.nope") || hasPath(req, "update_mask.paths.x") {
		t.Error("hasPath")
	}
}

// TestMethodRuleSelf: WhoAmI's self annotation is a rule with no resource
// or verb, and no resource of Resources; a self annotation that names
// anything else is refused.
func TestMethodRuleSelf(t *testing.T) {
	md := clusterv1.File_pivirt_cluster_v1_cluster_proto.Services().ByName("ClusterService").Methods().ByName("WhoAmI")
	r, err := MethodRule(md)
	if err != nil || !r.GetSelf() || r.GetResource() != "" || r.GetVerb() != "" {
		t.Fatalf("MethodRule of WhoAmI = %v, %v; want a self rule", r, err)
	}
	if got := Resources(md.Parent().(protoreflect.ServiceDescriptor)); slices.Contains(got, "") {
		t.Errorf("Resources = %q, holds the self method's empty resource", got)
	}
	for _, bad := range []*apiv1.Authorization{
		{Self: true, Resource: "virtualmachines", Verb: "get"},
		{Self: true, IdField: "id"},
	} {
		if _, err := MethodRule(withRule(t, bad)); err == nil || !strings.Contains(err.Error(), "a self method names no resource") {
			t.Errorf("MethodRule of %v = %v, want a refusal", bad, err)
		}
	}
}

// withRule is a method test.v1.T.M annotated with a.
func withRule(t *testing.T, a *apiv1.Authorization) protoreflect.MethodDescriptor {
	t.Helper()
	opts := &descriptorpb.MethodOptions{}
	proto.SetExtension(opts, apiv1.E_Authz, a)
	fdp := &descriptorpb.FileDescriptorProto{
		Name:    proto.String("test/self.proto"),
		Package: proto.String("test.v1"),
		Syntax:  proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name:  proto.String("Req"),
			Field: []*descriptorpb.FieldDescriptorProto{{Name: proto.String("id"), Number: proto.Int32(1), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}},
		}},
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name:   proto.String("T"),
			Method: []*descriptorpb.MethodDescriptorProto{{Name: proto.String("M"), InputType: proto.String(".test.v1.Req"), OutputType: proto.String(".test.v1.Req"), Options: opts}},
		}},
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	if err != nil {
		t.Fatal(err)
	}
	return fd.Services().Get(0).Methods().Get(0)
}
