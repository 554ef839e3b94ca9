package gateway

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/timestamppb"

	"pilab.hu/pivirt-agent/gateway/access"
	"pilab.hu/pivirt-agent/gateway/authz"
	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
)

// WhoAmI implements clusterv1connect.ClusterServiceHandler: the caller the
// guard authenticated for this call (authz.PrincipalFrom, where the guard
// records it) and what the RBAC policy in force on this node lets it call,
// method by method, as the guard decides (Explain). Never forwarded: the
// answer is this node's. It answers only about the caller, so the guard
// checks no rule for it (the self annotation), only that it authenticated.
func (h *ClusterService) WhoAmI(ctx context.Context, req *connect.Request[clusterv1.WhoAmIRequest]) (*connect.Response[clusterv1.WhoAmIResponse], error) {
	if h.cfg.Explain == nil {
		return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this agent has no access control to answer from"))
	}
	who, ok := authz.PrincipalFrom(ctx)
	if !ok {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("the call has no authenticated caller: send a bearer token or a client certificate of the PiTrust chain"))
	}
	methods := req.Msg.GetMethods()
	all := MethodNames(h.cfg.APIServices)
	if len(methods) == 0 {
		methods = all
	}
	// Any authenticated caller may ask: no more names than the API has
	// (each is a policy decision and a line of the answer).
	if len(methods) > len(all) {
		return nil, toConnect(invalid("methods", "%d names: at most %d (the API's methods; none asks for all)", len(methods), len(all)))
	}
	list := make([]*clusterv1.MethodAccess, 0, len(methods))
	for i, m := range methods {
		at := fmt.Sprintf("methods[%d]", i)
		full, err := ResolveMethod(h.cfg.APIServices, m)
		if err != nil {
			return nil, toConnect(invalid(at, "%v", err))
		}
		e, err := h.cfg.Explain(who, full, "")
		switch {
		case errors.Is(err, access.ErrUnknownMethod):
			return nil, toConnect(invalid(at, "%q is not a method of the API", m))
		case errors.Is(err, access.ErrCheck):
			// The guard denies a call whose rules' conditions cannot be
			// evaluated for the caller.
			e.Decision = "denied"
		case err != nil:
			return nil, toConnect(err)
		}
		list = append(list, &clusterv1.MethodAccess{Method: full, Resource: e.Resource, Verb: e.Verb, Decision: e.Decision})
	}
	source := "none"
	if h.cfg.PolicySource != nil {
		source = h.cfg.PolicySource()
	}
	resp := &clusterv1.WhoAmIResponse{
		Identity:        who.Identity,
		Roles:           slices.Clone(who.Roles),
		AuthenticatedBy: "token",
		Node:            h.cfg.NodeName,
		Source:          source,
		Access:          list,
	}
	if who.Certificate {
		resp.AuthenticatedBy = "certificate"
	} else if !who.Expiry.IsZero() {
		resp.TokenExpiry = timestamppb.New(who.Expiry)
	}
	return connect.NewResponse(resp), nil
}

// MethodNames lists the full names ("/pivirt.vm.v1.VMService/PowerOn") of
// every method of services, sorted.
func MethodNames(services []protoreflect.ServiceDescriptor) []string {
	var out []string
	for _, sd := range services {
		for i := range sd.Methods().Len() {
			out = append(out, "/"+string(sd.FullName())+"/"+string(sd.Methods().Get(i).Name()))
		}
	}
	slices.Sort(out)
	return out
}

// ResolveMethod resolves "VMService/DeleteVM" (a service of services by
// its short name) or "pivirt.vm.v1.VMService/DeleteVM", with or without a
// leading slash, to "/pivirt.vm.v1.VMService/DeleteVM". A full service
// name is not looked up: whether the method exists is the guard's to say.
func ResolveMethod(services []protoreflect.ServiceDescriptor, m string) (string, error) {
	m = strings.TrimPrefix(m, "/")
	svc, name, ok := strings.Cut(m, "/")
	if !ok || svc == "" || name == "" {
		return "", fmt.Errorf("%q: want Service/Method (\"VMService/DeleteVM\" or \"pivirt.vm.v1.VMService/DeleteVM\")", m)
	}
	if !strings.Contains(svc, ".") {
		var matches []string
		for _, sd := range services {
			if string(sd.Name()) == svc {
				matches = append(matches, string(sd.FullName()))
			}
		}
		if len(matches) != 1 {
			return "", fmt.Errorf("%q: no service of the API is named %s (use the full name, pivirt.vm.v1.VMService)", m, svc)
		}
		svc = matches[0]
	}
	return "/" + svc + "/" + name, nil
}
