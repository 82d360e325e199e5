"""Figures: matplotlib Gantt charts, plotly interactive HTML, the comparison report."""
