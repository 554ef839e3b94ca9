//lint:file-ignore SA1019 v1alpha reflection is deprecated, and still what older grpcurl and other tools speak: the agent serves it, so this checks it.

package agent_test

import (
	"context"

	"google.golang.org/grpc"
	reflectionv1alpha "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
)

// listServicesV1alpha lists the services of conn's server through v1alpha
// reflection.
func listServicesV1alpha(ctx context.Context, conn *grpc.ClientConn) ([]string, error) {
	s, err := reflectionv1alpha.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.Send(&reflectionv1alpha.ServerReflectionRequest{MessageRequest: &reflectionv1alpha.ServerReflectionRequest_ListServices{}}); err != nil {
		return nil, err
	}
	r, err := s.Recv()
	var out []string
	for _, svc := range r.GetListServicesResponse().GetService() {
		out = append(out, svc.GetName())
	}
	return out, err
}
